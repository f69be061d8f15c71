"""A read aborted while its bytes are in flight must not write after its completion (a real partition).

UCX cannot stop a READ: released at the deadline, it still lands when the
link is back. Before the fix the decode engine's memory changed seconds
after the daemon had said the read failed (the soak's ``bytes_right``
caught it as wrong bytes in the next request). The daemon now holds the
completion until the transfer ended (``abort_drain_s``); with
``--abort-drain-s 0`` (the negative control) the late write shows again.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from kvxferd.rig.engines import SoakPrefill
from kvxferd.rig.hosts import SoakHosts
from kvxferd.rig.verify.hosts.fabric import unavailable
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.rig.verify.process import EngineProcess
from tests.rig.verify.hosts.probe_engines import FingerprintDecode

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"namespace hosts: {REASON}")
PARTITION_S = 2.0
DEADLINE_S = 1.0
IN_FLIGHT_BYTES = 2 << 20  # of a 128 MiB read: well inside it
SLOW_LINK_S = 0.02  # each packet into the decode host held that long, until the heal


def partitioned_read(tmp_path, abort_drain_s: float) -> tuple[dict, list[str], list[str]]:
    """Read a request over a slowed link, partition the hosts once 2 MiB of it crossed, heal (both) after
    PARTITION_S; the
    read's outcome, the decode memory's digests when its completion came and 5 s after the heal."""
    hosts = SoakHosts(2, 1, str(tmp_path), ("--log-level", "WARNING", "--abort-drain-s", str(abort_drain_s)))
    prefill = decode = None
    try:
        groups, _ = model_groups("gqa", ModelShape(num_layers=8, num_kv_heads=8, head_size=128, num_blocks=256))
        prefill_daemon, decode_daemon = hosts.daemons.prefill[0].daemon, hosts.daemons.decode[0].daemon
        prefill = EngineProcess("prefill", "late-prefill", groups, [prefill_daemon.engine_target],
                                factory=SoakPrefill, lease_s=30, **hosts.role_options("prefill"))
        decode = EngineProcess("decode", "late-decode", groups, [decode_daemon.engine_target],
                               factory=FingerprintDecode, lease_s=30, **hosts.role_options("decode"))
        assert decode.call("handshake", "late-prefill", [prefill_daemon.peer_address]) == ["ok"]
        request = random_request("late-r", groups, groups, 2000, np.random.default_rng(3))
        answers = prefill.call("hold", request.remote_request_id, request.remote_block_ids, 30.0)
        request = dataclasses.replace(request, remote_capabilities=tuple(c for _, c, _ in answers))
        # Slow the link first: on its own the read crossed it in 0.25 s on a loaded machine, before the
        # partition's four iptables calls were in, and it ended ok (a clean clone's run, 2026-11-29).
        # Held 20 ms on its way in, every packet of it is still on the wire when the cut comes.
        hosts.links.delay(hosts.decode_host, SLOW_LINK_S)
        received = hosts.fabric.link_bytes(hosts.decode_host)["rx_bytes"]
        decode.send("read", request, "late-prefill", groups, DEADLINE_S, 60.0)
        # Cut the link once the read's bytes are crossing it (a read not yet on the wire could be dropped
        # whole by UCX, and would show nothing).
        give_up_s = time.monotonic() + 30.0
        while hosts.fabric.link_bytes(hosts.decode_host)["rx_bytes"] - received < IN_FLIGHT_BYTES:
            assert time.monotonic() < give_up_s, "the read never started crossing the link"
            time.sleep(0.001)
        hosts.links.partition(hosts.prefill_host, hosts.decode_host)
        heal = threading.Timer(PARTITION_S, lambda: [hosts.links.clear(h) for h in (hosts.prefill_host,
                                                                                  hosts.decode_host)])
        heal.start()
        result = decode.answer("read", 120)
        heal.join()
        time.sleep(5.0)
        at_completion, later = decode.call("fingerprints")
        return result["ranks"][0], at_completion, later
    finally:
        for engine in (decode, prefill):
            if engine is not None:
                engine.close()
        hosts.close()


def test_an_aborted_read_writes_nothing_after_its_completion(tmp_path):
    outcome, at_completion, later = partitioned_read(tmp_path, abort_drain_s=30.0)
    assert outcome["outcome"] == "failed" and "deadline" in outcome["error"], outcome
    assert not outcome["problems"], outcome["problems"]
    assert later == at_completion  # nothing landed after the engine was told
    assert outcome["latency_s"] >= PARTITION_S  # it waited for the link to come back, and the transfer to end


def test_without_the_drain_the_late_write_shows(tmp_path):
    """The negative control: released at the deadline, the transfer still writes once the link is back."""
    outcome, at_completion, later = partitioned_read(tmp_path, abort_drain_s=0.0)
    assert outcome["outcome"] == "failed" and outcome["latency_s"] < PARTITION_S
    assert later != at_completion
