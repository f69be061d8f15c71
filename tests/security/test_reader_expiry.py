"""Issue 53, M2: introduced readers are kept per peer identity, capped, replaced only loudly, and expire.

Before, an introduction lasted the holder registration's life and belonged
to whoever made it first: a second allowed identity that named a reader
before its owner held the owner out (PERMISSION_DENIED for the
registration's life), one identity filled ``max_readers_per_engine`` with
made-up readers, and within one identity a re-introduction silently
replaced the real reader's agent. Now each identity has its own entries
(``kvxferd.xfer.readers``), at most ``max_readers_per_identity`` of them;
an entry idle for ``reader_idle_s`` gives up its place to a new reader; a
replaced agent is an audit line. Both configurations: the default (no TLS,
the host's peer secret: one identity) and the chart's (mutual TLS; here two
allowed identities, as a shared issuer and a wider allow-list would admit).
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import EngineClient
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.names import env_name
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from tests.security.conftest import SPIFFE, tls_args
from tests.service.helpers import engine_pb

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
OTHER = "spiffe://kvxferd.test/ns/other-tenant/sa/kvxferd"  # allowed too, but not the readers' identity
CAP, IDLE_S = 3, 1.5
FILL_TARGET = "expiry-fill-target"  # an engine of the prefill daemon that only made-up readers name


@pytest.fixture(scope="module", params=["default", "chart"])
def cluster(request, workdir, ca):
    args = ("--peer-check-s", "60")  # no probe re-handshakes behind the tests' backs
    if request.param == "chart":
        issued = ca.issue("expiry", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
        args = (*tls_args(ca, issued, allowed=f"{SPIFFE},{OTHER}"), *args)
    # The limits as a pod's environment sets them (a daemon without these options ignores them: the attacks
    # then show what they did before).
    with pytest.MonkeyPatch.context() as env:
        env.setenv(env_name("max_readers_per_identity"), str(CAP))
        env.setenv(env_name("reader_idle_s"), str(IDLE_S))
        with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name=f"expiry-{request.param}", daemon_args=args) as c:
            c.param = request.param
            yield c


class Peer:
    """Peer calls to the prefill daemon as one identity (without TLS: the host's one identity)."""

    def __init__(self, cluster, ca, spiffe_id: str) -> None:
        address = cluster.prefill_daemons[0].peer_address
        if cluster.param == "default":
            self.channel = peer_channel(address)
        else:
            issued = ca.issue(spiffe_id.rsplit("/", 3)[-3] + "-expiry", dns_names=("kvxferd-peer",), spiffe_id=spiffe_id)
            credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                                       issued.cert.read_bytes())
            self.channel = grpc.secure_channel(address, credentials,
                                               options=[("grpc.ssl_target_name_override", "kvxferd-peer")])
        self.stub = peer_grpc.PeerServiceStub(self.channel)

    def introduce(self, engine_id: str, reader_engine_id: str, agent_name: str) -> tuple[C, str]:
        """Introduce ``agent_name`` as rank 0 (TP 1) of ``reader_engine_id`` to ``engine_id``: (code, details)."""
        try:
            self.stub.GetEngineInfo(pb.EngineInfoRequest(
                engine_id=engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id=reader_engine_id,
                reader_tp_rank=0, reader_tp_size=1, reader_agent_metadata=agent_metadata(agent_name)), timeout=10)
            return C.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()


def agent_metadata(name: str) -> bytes:
    """The header of NIXL agent metadata naming ``name``: all a holder reads of an introduction (a made-up
    reader needs no agent)."""
    raw = name.encode()
    return b"nixlSerDes|Agent" + len(raw).to_bytes(8, "little") + raw + b"|"


def squatter(cluster, ca) -> Peer:
    """Another allowed identity (chart); without TLS every daemon of the host is the readers' own identity."""
    return Peer(cluster, ca, OTHER)


def owner(cluster, ca) -> Peer:
    """The identity the decode daemon reads with."""
    return Peer(cluster, ca, SPIFFE)


def consumed(cluster, name: str, seed: int) -> list:
    """Read a new request once; the prefill side's terminal events (CONSUMED when the reader's notice counted)."""
    request = random_request(name, *GROUPS, 32, np.random.default_rng(seed))
    cluster.hold(request, lease_s=60)
    cluster.submit(request)
    assert all(c.ok for c in cluster.completions(request))
    return [e.kind for e in cluster.hold_events(request, timeout_s=10)]


def log_lines(cluster, logger: str) -> list[dict]:
    return [json.loads(line) for line in cluster.prefill_daemons[0].tail(1_000_000).splitlines()
            if line.startswith("{") and f'"{logger}"' in line]


def fill(peer: Peer, engine_id: str, prefix: str) -> tuple[int, C, str]:
    """Introduce made-up readers until one is refused: (how many got in, the refusal's code and details)."""
    for n in range(4 * CAP):
        code, details = peer.introduce(engine_id, f"{prefix}-{n}", f"{prefix}-agent-{n}")
        if code != C.OK:
            return n, code, details
    return 4 * CAP, C.OK, ""


def test_a_replacement_needs_the_same_identity_and_is_logged(cluster, ca):
    assert consumed(cluster, "expiry-replace-0", 0) == [pb.NotifyEvent.CONSUMED]
    if cluster.param == "chart":  # another identity naming the reader makes its own entry: no takeover
        with squatter(cluster, ca) as peer:
            assert peer.introduce(cluster.prefill_id, cluster.decode_id, "expiry-other-agent") == (C.OK, "")
        assert consumed(cluster, "expiry-replace-1", 1) == [pb.NotifyEvent.CONSUMED]
        assert not [r for r in log_lines(cluster, "kvxferd.audit") if r.get("outcome") == "REPLACED"]
    with owner(cluster, ca) as peer:  # the reader's own identity: a replacement, and it says so
        assert peer.introduce(cluster.prefill_id, cluster.decode_id, "expiry-rogue-agent") == (C.OK, "")
    cluster.handshake()  # the decode daemon introduces its agent again (an engine's Handshake re-introduces)
    replaced = [r for r in log_lines(cluster, "kvxferd.audit") if r.get("outcome") == "REPLACED"]
    assert [(r["reader"], r["new_agent"]) for r in replaced][-2:] == [
        (f"{cluster.decode_id}/0", "expiry-rogue-agent"), (f"{cluster.decode_id}/0", replaced[-2]["old_agent"])]
    assert replaced[-1]["old_agent"] == "expiry-rogue-agent" and replaced[-2]["old_agent"].endswith(".notices")
    if cluster.param == "chart":
        assert {r["identity"] for r in replaced[-2:]} == {f"uri:{SPIFFE}"}
    assert consumed(cluster, "expiry-replace-2", 2) == [pb.NotifyEvent.CONSUMED]  # the real agent counts again


def test_a_squatter_does_not_hold_the_owner_out(cluster, ca):
    """The squat: a fresh holder registration, a reader id named by someone else before its owner."""
    cluster.restart_prefill(0)  # a new registration knows no readers; the decode daemon has not noticed yet
    with squatter(cluster, ca) as peer:
        assert peer.introduce(cluster.prefill_id, cluster.decode_id, "expiry-squat-agent") == (C.OK, "")
    cluster.handshake()  # the owner introduces itself: admitted at once (before: PERMISSION_DENIED)
    assert consumed(cluster, "expiry-squat", 3) == [pb.NotifyEvent.CONSUMED]


def test_one_identity_cannot_fill_the_readers(cluster, ca):
    arenas, client = [], EngineClient(cluster.prefill_daemons[0].engine_target)
    try:
        client.register(engine_pb(GROUPS[0], FILL_TARGET, arenas))
        with squatter(cluster, ca) as peer:
            admitted, code, details = fill(peer, FILL_TARGET, "expiry-fill")
        assert (admitted, code) == (CAP, C.RESOURCE_EXHAUSTED) and details.startswith("max_readers_per_identity")
        if cluster.param == "chart":  # another identity still gets in
            with owner(cluster, ca) as peer:
                assert peer.introduce(FILL_TARGET, "expiry-fill-owner", "expiry-fill-owner-agent") == (C.OK, "")
        time.sleep(IDLE_S + 0.5)  # the made-up readers expire: a new one takes the place of one of them
        with squatter(cluster, ca) as peer:
            assert peer.introduce(FILL_TARGET, "expiry-fill-late", "expiry-fill-late-agent") == (C.OK, "")
        assert consumed(cluster, "expiry-fill", 4) == [pb.NotifyEvent.CONSUMED]  # the real reader is untouched
    finally:
        client.deregister()
        client.close()
        for arena in arenas:
            arena.close()


def test_an_idle_reader_keeps_counting_gives_up_its_place_and_is_introduced_again(cluster, ca):
    time.sleep(IDLE_S + 0.5)
    assert consumed(cluster, "expiry-idle-0", 5) == [pb.NotifyEvent.CONSUMED]  # expired, in place: still counts
    time.sleep(IDLE_S + 0.5)
    with owner(cluster, ca) as peer:  # the reader's own identity needs places: the idle reader gives up its own
        admitted, code, details = fill(peer, cluster.prefill_id, "expiry-idle")
    assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_readers_per_identity") and admitted <= CAP
    evicted = [r["reader"] for r in log_lines(cluster, "kvxferd.xfer.holder") if "gave up its place" in r["msg"]]
    assert f"{cluster.decode_id}/0" in evicted, evicted
    time.sleep(IDLE_S + 0.5)  # the made-up readers expire in turn
    cluster.handshake()  # the decode daemon introduces its reader again
    assert consumed(cluster, "expiry-idle-1", 6) == [pb.NotifyEvent.CONSUMED]
