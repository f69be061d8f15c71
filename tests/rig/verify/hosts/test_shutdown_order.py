"""A pod's shutdown in the chart's native-sidecar order, on namespace hosts with a decode host reading (issue #60).

Kubernetes stops a pod's main container (the engine) first and its native
sidecars (the daemons) after it. Each test holds one request on the prefill
host, slows the link so that its read is still crossing it, and stops one
side in that order while the bytes are on the wire::

    prefill host                       decode host
    engine ─ hold ─► daemon ═══ READ (in flight, 5 ms a packet) ═══► daemon ─► engine

Nothing may be lost: the read ends with a completion (bytes right, or failed
with its blocks named invalid: never cut short and called ok), the hold ends
on the bus, and every daemon leaves with exit code 0 after its drain. The
contrast is a daemon stopped while its engine still reads (what ordinary
containers allow): its drain lets the read finish; with no drain
(``--drain-timeout-s 0``, the negative control) the same read fails.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxferd.rig.engines import SoakDecode
from kvxferd.rig.hosts import SoakHosts
from kvxferd.rig.verify.hosts.fabric import unavailable
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.rig.verify.process import EngineProcess
from tests.rig.verify.hosts.probe_engines import WatchedPrefill

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"namespace hosts: {REASON}")
SHAPE = ModelShape(num_layers=8, num_kv_heads=8, head_size=128, num_blocks=256)
IN_FLIGHT_BYTES = 2 << 20  # of a 128 MiB read: well inside it
SLOW_LINK_S = 0.005  # each packet into the decode host held that long: the read takes seconds
DEADLINE_S = 30.0  # longer than any read here: a read that fails, fails for the shutdown


class InFlight:
    """Two namespace hosts, a prefill and a decode engine process, one request held and its read crossing."""

    def __init__(self, tmp_path, drain_timeout_s: float = 20.0) -> None:
        self.hosts = SoakHosts(2, 1, str(tmp_path), ("--log-level", "INFO", "--drain-timeout-s", str(drain_timeout_s)))
        self.prefill = self.decode = None
        self.prefill_daemon = self.hosts.daemons.prefill[0].daemon
        self.decode_daemon = self.hosts.daemons.decode[0].daemon
        self.groups, _ = model_groups("gqa", SHAPE)
        self.prefill = EngineProcess("prefill", "stop-prefill", self.groups, [self.prefill_daemon.engine_target],
                                     factory=WatchedPrefill, lease_s=60, **self.hosts.role_options("prefill"))
        self.decode = EngineProcess("decode", "stop-decode", self.groups, [self.decode_daemon.engine_target],
                                    factory=SoakDecode, lease_s=60, **self.hosts.role_options("decode"))
        assert self.decode.call("handshake", "stop-prefill", [self.prefill_daemon.peer_address]) == ["ok"]

    def start_read(self, wait_in_engine: bool = True) -> str:
        """Hold a 2000-token request and start its read; returns once its bytes are crossing the link.
        ``wait_in_engine``: the decode engine waits for the completion and checks it (collect it with
        ``decode.answer("read")``); else it only submits, and can be told to stop meanwhile."""
        request = random_request("stop-r", self.groups, self.groups, 2000, np.random.default_rng(60))
        answers = self.prefill.call("hold", request.remote_request_id, request.remote_block_ids, 60.0)
        assert [a for a, _, _ in answers] == ["ok"], answers
        request = request.__class__(**{**request.__dict__, "remote_capabilities": tuple(c for _, c, _ in answers)})
        self.hosts.links.delay(self.hosts.decode_host, SLOW_LINK_S)
        received = self.hosts.fabric.link_bytes(self.hosts.decode_host)["rx_bytes"]
        if wait_in_engine:
            self.decode.send("read", request, "stop-prefill", self.groups, DEADLINE_S, 120.0)
        else:
            self.decode.call("submit", request, "stop-prefill", DEADLINE_S)
        give_up_s = time.monotonic() + 30.0
        while self.hosts.fabric.link_bytes(self.hosts.decode_host)["rx_bytes"] - received < IN_FLIGHT_BYTES:
            assert time.monotonic() < give_up_s, "the read never started crossing the link"
            time.sleep(0.001)
        return request.remote_request_id

    def hold_end(self, request_id: str) -> list[str | None]:
        """How the prefill's hold ended on its bus (CONSUMED or EXPIRED; None: it did not within 30 s)."""
        return self.prefill.call("hold_end", request_id, 30.0)

    def close(self) -> None:
        for engine in (self.decode, self.prefill):
            if engine is not None:
                engine.close()
        self.hosts.close()


@pytest.fixture
def in_flight(tmp_path):
    rig = InFlight(tmp_path)
    yield rig
    rig.close()


def _read_ended_cleanly(result: dict) -> dict:
    (rank,) = result["ranks"]
    assert rank["outcome"] in ("ok", "failed"), rank  # not lost, not missing: a completion came
    assert not rank["problems"], rank["problems"]  # ok: every byte right; failed: nothing written outside
    return rank


def _stopped_after_its_drain(daemon) -> None:
    code = daemon.terminate(timeout_s=60)
    assert code == 0, daemon.tail(4000)
    assert '"drained"' in daemon.tail(20000), daemon.tail(4000)


@pytest.mark.parametrize("drain_timeout_s", [20.0, 0.0], ids=["holds-read-first", "no-wait"])
def test_a_prefill_pod_stopping_its_engine_then_its_daemon_mid_read_loses_nothing(tmp_path, drain_timeout_s):
    """The prefill pod goes while decode reads from it: its engine deregisters and frees its cache, then its
    daemon gets SIGTERM. The engine's Deregister lets its hold be read first (the daemon's mapping keeps the
    freed cache's pages), and SIGTERM waits for it within the drain: the read ends ok with every byte right
    and the daemon exits 0. Before, the prefill
    daemon unmapped the cache at once and died (SIGSEGV) in UCX serving the READ from it, or the read failed:
    what ``--drain-timeout-s 0`` (no wait) still shows, the negative control."""
    in_flight = InFlight(tmp_path, drain_timeout_s=drain_timeout_s)
    try:
        in_flight.start_read()
        in_flight.prefill.close()  # the engine stops first (the main container): its Deregister waits for the hold
        in_flight.prefill = None
        if drain_timeout_s:
            _stopped_after_its_drain(in_flight.prefill_daemon)
        else:
            in_flight.prefill_daemon.terminate(timeout_s=60)  # (it may have died already)
        rank = _read_ended_cleanly(in_flight.decode.answer("read", 120))
        assert rank["outcome"] == ("ok" if drain_timeout_s else "failed"), rank
        assert in_flight.decode_daemon.process.poll() is None
        assert in_flight.decode_daemon.metric("kvxferd_reads_in_flight") == 0
    finally:
        in_flight.close()


def test_a_decode_pod_stopping_its_engine_then_its_daemon_mid_read_ends_the_prefill_hold(in_flight):
    """The decode pod goes mid-read: its engine deregisters and frees its cache, then its daemon drains and
    exits 0. The engine's Deregister lets its read run out into the memory its daemon still maps, so the
    prefill's hold ends CONSUMED, and the prefill daemon serves on. Before, the read was aborted and its
    agent closed mid-transfer, and the *prefill* daemon died (SIGSEGV in UCX's progress of its emulated
    RMA over TCP) in about one run in ten."""
    request_id = in_flight.start_read(wait_in_engine=False)
    in_flight.decode.close()  # the engine stops first: deregisters (its read fails), frees its cache
    assert in_flight.decode.process.exitcode == 0
    in_flight.decode = None
    _stopped_after_its_drain(in_flight.decode_daemon)
    assert in_flight.hold_end(request_id) == ["CONSUMED"]  # it ended, read whole: its blocks may go
    assert in_flight.prefill_daemon.process.poll() is None, in_flight.prefill_daemon.tail(6000)


@pytest.mark.parametrize("drain_timeout_s", [20.0, 0.0], ids=["drained", "no-drain"])
def test_a_decode_daemon_stopped_before_its_engine_drains_the_read_in_flight(tmp_path, drain_timeout_s):
    """What ordinary containers allow: SIGTERM reaches the decode daemon while its engine still waits for a
    read. The drain lets the read finish (every byte right) before the daemon deregisters its engine; with
    no drain (the negative control) the same read is failed at once."""
    rig = InFlight(tmp_path, drain_timeout_s=drain_timeout_s)
    try:
        request_id = rig.start_read()
        code = rig.decode_daemon.terminate(timeout_s=60)
        assert code == 0, rig.decode_daemon.tail(4000)
        rank = _read_ended_cleanly(rig.decode.answer("read", 120))
        assert rank["outcome"] == ("ok" if drain_timeout_s else "failed"), rank
        if drain_timeout_s:
            assert rig.hold_end(request_id) == ["CONSUMED"]
    finally:
        rig.close()
