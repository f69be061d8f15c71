"""Issue #55's UCX-abort case across namespace hosts, approached as closely as this machine allows.

In issue #38's runs UCX aborted a holder daemon once in six (``ucp_request.inl:356 Fatal: unexpected
error: Endpoint timeout``, a software GET over TCP) when a reader's link broke mid-reply on a large read,
and every engine's holds on that GPU went with it. Here, with ``--dataplane-workers``, the same cut is
made on real links between two network namespaces (mutual TLS, the chart's policy, UCX over TCP): a
large read is crossing the link when the hosts are partitioned; while they are, the holder's worker gets
the ``abort()`` UCX's fatal error ends in (SIGABRT: UCX does not abort on cue, so the test delivers it).
The holder's control plane must answer its engine throughout, keep the other hold, and serve it
byte-exact through a new worker once the link is back.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from kvxferd.rig.daemons import dataplane_workers
from kvxferd.rig.engines import SoakDecode, SoakPrefill
from kvxferd.rig.hosts import SoakHosts
from kvxferd.rig.verify.hosts.fabric import unavailable
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.rig.verify.process import EngineProcess

REASON = unavailable()
pytestmark = [pytest.mark.daemons, pytest.mark.skipif(REASON is not None, reason=f"namespace hosts: {REASON}")]
PARTITION_S = 3.0
IN_FLIGHT_BYTES = 2 << 20  # of a read of about 60 MiB: well inside it
SLOW_LINK_S = 0.02  # each packet into the decode host held that long, so the read is on the wire at the cut
BACK_S = 30.0  # the new worker serves the kept hold within this once the link is back
CONSUMED = 'kind="CONSUMED"'


def held(prefill: EngineProcess, request):
    answers = prefill.call("hold", request.remote_request_id, request.remote_block_ids, 60.0)
    assert all(capability for _, capability, _ in answers), answers
    return dataclasses.replace(request, remote_capabilities=tuple(c for _, c, _ in answers))


def test_a_link_cut_mid_reply_and_the_workers_abort_leave_the_holder_and_its_holds(tmp_path):
    hosts = SoakHosts(2, 1, str(tmp_path), ("--log-level", "INFO", "--dataplane-workers", "--abort-drain-s", "10"))
    prefill = decode = None
    try:
        groups, _ = model_groups("gqa", ModelShape(num_layers=8, num_kv_heads=8, head_size=128, num_blocks=256))
        holder, reader = hosts.daemons.prefill[0].daemon, hosts.daemons.decode[0].daemon
        prefill = EngineProcess("prefill", "cut-prefill", groups, [holder.engine_target], factory=SoakPrefill,
                                lease_s=30, **hosts.role_options("prefill"))
        decode = EngineProcess("decode", "cut-decode", groups, [reader.engine_target], factory=SoakDecode,
                               lease_s=30, **hosts.role_options("decode"))
        assert decode.call("handshake", "cut-prefill", [holder.peer_address]) == ["ok"]
        rng = np.random.default_rng(5)
        cut, kept = (held(prefill, random_request(name, groups, groups, 1900, rng)) for name in ("cut", "kept"))
        (worker,) = dataplane_workers(holder.process.pid, "holder")
        consumed = holder.metric("kvxferd_notify_events_total", CONSUMED)

        hosts.links.delay(hosts.decode_host, SLOW_LINK_S)
        received = hosts.fabric.link_bytes(hosts.decode_host)["rx_bytes"]
        decode.send("read", cut, "cut-prefill", groups, 1.0, 120.0)
        give_up_s = time.monotonic() + 30.0
        while hosts.fabric.link_bytes(hosts.decode_host)["rx_bytes"] - received < IN_FLIGHT_BYTES:
            assert time.monotonic() < give_up_s, "the read never started crossing the link"
            time.sleep(0.001)
        hosts.links.partition(hosts.prefill_host, hosts.decode_host)  # mid-reply: its bytes are on the wire
        cut_s = time.monotonic()
        aborted_by_ucx = worker not in dataplane_workers(holder.process.pid)
        if not aborted_by_ucx:
            os.kill(worker, signal.SIGABRT)  # what UCX's "Fatal: ... Endpoint timeout" ends in
        # While the link is down and no worker serves: the control plane answers its engine and holds anew.
        third = held(prefill, random_request("during", groups, groups, 64, rng))
        assert holder.metric("kvxferd_engines_registered") == 1
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_s)))
        for host in (hosts.prefill_host, hosts.decode_host):
            hosts.links.clear(host)

        outcome = decode.answer("read", 180)["ranks"][0]
        assert outcome["outcome"] in ("ok", "failed") and not outcome["problems"], outcome  # no wrong byte
        deadline, attempts = time.monotonic() + BACK_S, 0
        while True:  # the kept hold, through the new worker (the reader's probe re-handshakes it)
            attempts += 1
            decode.send("read", kept, "cut-prefill", groups, 5.0, 60.0)
            result = decode.answer("read", 90)["ranks"][0]
            assert not result["problems"], result
            if result["outcome"] == "ok" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert result["outcome"] == "ok", result
        assert holder.process.poll() is None, holder.tail()  # the control plane lived through it
        assert worker not in dataplane_workers(holder.process.pid) and dataplane_workers(holder.process.pid)
        assert holder.metric("kvxferd_dataplane_worker_deaths_total") == 1
        deadline = time.monotonic() + 10
        while holder.metric("kvxferd_notify_events_total", CONSUMED) <= consumed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holder.metric("kvxferd_notify_events_total", CONSUMED) > consumed  # the kept hold ended read
        prefill.call("release", third.remote_request_id)
        print(f"cut read: {outcome['outcome']} after {outcome['latency_s']:.2f} s; UCX aborted the worker "
              f"itself: {aborted_by_ucx}; the kept hold read ok on attempt {attempts}")
    finally:
        for engine in (decode, prefill):
            if engine is not None:
                engine.close()
        hosts.close()
