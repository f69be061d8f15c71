"""Issue 11: every configured limit answers RESOURCE_EXHAUSTED naming itself; INTERNAL never leaks details;
engine TCP needs TLS and the bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.wire.peerauth import peer_channel
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.names import SHM_DIR
from kvxferd.service.net.servicers import rpc
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.verify.models import ModelShape, model_groups
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.security.conftest import SPIFFE
from tests.service.helpers import engine_pb, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())


def introduce(peer, engine_id: str, reader: str, agent: NixlAgent):
    """``GetEngineInfo`` of rank 0 of ``engine_id`` by reader engine ``reader`` (TP 1), introducing ``agent``."""
    return peer.GetEngineInfo(pb.EngineInfoRequest(
        engine_id=engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id=reader,
        reader_tp_rank=0, reader_tp_size=1, reader_agent_metadata=agent.metadata()), timeout=10)


@pytest.fixture(scope="module")
def limited(workdir):
    daemon = DaemonProcess("limits", socket_dir=workdir, extra_args=(
        "--max-engines", "2", "--max-holds-per-engine", "2", "--max-readers-per-engine", "1"))
    yield daemon
    daemon.terminate()


def test_limits_name_themselves(limited):
    arenas, clients = [], []
    try:
        for name in ("lim-a", "lim-b"):
            clients.append(EngineClient(limited.engine_target))
            clients[-1].register(engine_pb(GROUPS[0], name, arenas))
        code, details = status(lambda: EngineClient(limited.engine_target).register(engine_pb(GROUPS[0], "lim-c", arenas)))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_engines"), details
        first = clients[0]
        first.hold("h1", [[1]])
        first.hold("h2", [[2]])
        code, details = status(lambda: first.hold("h3", [[3]]))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_holds_per_engine"), details
        first.release("h1")
        first.hold("h3", [[3]])  # room again
        peer = peer_grpc.PeerServiceStub(peer_channel(limited.peer_address))
        introduce(peer, "lim-a", "reader-1", NixlAgent("lim-reader-1"))
        code, details = status(lambda: introduce(peer, "lim-a", "reader-2", NixlAgent("lim-reader-2")))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_readers_per_engine"), details
    finally:
        for client in clients:
            client.deregister()
            client.close()
        for arena in arenas:
            arena.close()


def test_registered_bytes_are_bounded(workdir):
    daemon = DaemonProcess("bytes", socket_dir=workdir, extra_args=("--max-registered-bytes", "4096"))
    arenas = []
    try:
        code, details = status(lambda: EngineClient(daemon.engine_target).register(engine_pb(GROUPS[0], "big", arenas)))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_registered_bytes"), details
    finally:
        daemon.terminate()
        for arena in arenas:
            arena.close()


class _Context:
    """Just enough of a servicer context to see what an RPC answers."""

    def __init__(self) -> None:
        self.aborted = None

    async def abort(self, code, message):
        self.aborted = (code, message)


class _Broken:
    class daemon:  # noqa: N801 - the attribute the decorator reads
        class metrics:  # noqa: N801
            class rpc_errors:  # noqa: N801
                @staticmethod
                def labels(*_):
                    return type("C", (), {"inc": staticmethod(lambda: None)})

    def audit(self, *outcome):
        pass

    @rpc
    async def Explode(self, request, context):
        raise RuntimeError("could not open /var/secret/tenant-a.key")


def test_internal_errors_carry_an_id_and_no_detail(caplog):
    context = _Context()
    with caplog.at_level(logging.ERROR, logger="kvxferd.rpc"):
        asyncio.run(_Broken().Explode(None, context))
    code, message = context.aborted
    assert code == C.INTERNAL and "secret" not in message and "RuntimeError" not in message
    error_id = message.split()[2]
    record = next(r for r in caplog.records if getattr(r, "error_id", None) == error_id)
    assert "tenant-a.key" in record.exc_text  # the detail is in the log, under that id


def test_engine_tcp_needs_tls_and_the_token(workdir, ca: DevCA, tmp_path):
    issued = ca.issue("engine-tcp", dns_names=("kvxferd-engine", "kvxferd-peer"), spiffe_id=SPIFFE)
    token = "t0ken-" + "x" * 26
    (tmp_path / "token").write_text(token)
    daemon = DaemonProcess("tcp", socket_dir=workdir, extra_args=(
        "--engine-tcp", "127.0.0.1:0", "--engine-token-file", str(tmp_path / "token"),
        "--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(ca.cert_path),
        "--peer-allowed-ids", SPIFFE))
    arenas = []
    try:
        target = daemon.addresses["engine_tcp"]
        assert not target.endswith(":0"), "the ready line names the bound port"
        credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes())
        options = (("grpc.ssl_target_name_override", "kvxferd-engine"),)
        plain = EngineClient(target)
        assert status(lambda: plain.register(engine_pb(GROUPS[0], "tcp-a", arenas)))[0] == C.UNAVAILABLE
        no_token = EngineClient(target, credentials=credentials, channel_options=options)
        code, details = status(lambda: no_token.register(engine_pb(GROUPS[0], "tcp-a", arenas)))
        assert code == C.UNAUTHENTICATED and details.startswith("authorization"), details
        good = EngineClient(target, credentials=credentials, token=token, channel_options=options)
        message = engine_pb(GROUPS[0], "tcp-a", arenas)
        # Over engine_tcp a shm object is opened by name only if anyone may open it (test_local_uids).
        SHM_DIR.joinpath(arenas[-1].name).chmod(0o666)
        good.register(message)
        good.hold("r", [[1]])
        good.deregister()
    finally:
        daemon.terminate()
        for arena in arenas:
            arena.close()


def test_renewals_cannot_hold_blocks_past_max_hold_s(workdir):
    """Issue 35: an engine (or a peer) renewing without end pinned the blocks for ever; a hold's whole life,
    renewals included, is now at most ``max_hold_s``."""
    import time

    daemon = DaemonProcess("cap", socket_dir=workdir, extra_args=("--max-hold-s", "2"))
    arenas, client = [], EngineClient(daemon.engine_target)
    try:
        client.register(engine_pb(GROUPS[0], "cap-a", arenas))
        started = time.monotonic()
        client.hold("pinned", [[1]], lease_s=1)
        renewed_until = None
        while time.monotonic() - started < 4:
            if client.renew(["pinned"], lease_s=1):  # the id came back unknown: the hold ended
                renewed_until = time.monotonic() - started
                break
            time.sleep(0.2)
        assert renewed_until is not None and 1.9 < renewed_until < 3.0, renewed_until
        client.hold("pinned", [[1]], lease_s=1)  # ended, so the id may be held again
    finally:
        with contextlib.suppress(Exception):  # a registration that failed has nothing to deregister
            client.deregister()
        client.close()
        daemon.terminate()  # always: a daemon left running outlives the test run
        for arena in arenas:
            arena.close()


def test_peer_requests_are_bounded_apart_from_engine_messages(limited):
    """Issue 35: PeerService took 16 MiB requests (16 at once held 1 GiB). A peer sends only small requests:
    over ``max_peer_request_bytes`` (1 MiB) is RESOURCE_EXHAUSTED before any handler runs, while the engine
    port still takes messages up to ``max_message_bytes``."""
    big = "x" * (2 << 20)
    peer = peer_grpc.PeerServiceStub(peer_channel(limited.peer_address))
    code, _ = status(lambda: peer.GetIncarnation(pb.IncarnationRequest(engine_id=big), timeout=10))
    assert code == C.RESOURCE_EXHAUSTED, code
    code, _ = status(lambda: peer.GetIncarnation(pb.IncarnationRequest(engine_id=big[:1000]), timeout=10))
    assert code != C.RESOURCE_EXHAUSTED, code  # a small one is read (and refused for what it says)
    code, details = status(lambda: EngineClient(limited.engine_target).register(
        pb.EngineRank(engine_id=big[: (3 << 20) // 2], tp_size=1), lease_s=1))
    assert code == C.INVALID_ARGUMENT and "engine_id" in details, (code, details[:200])  # read, then refused


def test_every_peer_decision_is_an_audit_line(workdir):
    """Issue 35: one structured line per introduction, renewal and refusal on the peer port: who asked (TLS
    identity when on, address), what, of which engine, and the outcome."""
    import json

    daemon = DaemonProcess("audit", socket_dir=workdir, extra_args=("--max-readers-per-engine", "1"))
    arenas, client = [], EngineClient(daemon.engine_target)
    try:
        client.register(engine_pb(GROUPS[0], "aud-a", arenas))
        peer = peer_grpc.PeerServiceStub(peer_channel(daemon.peer_address))
        introduce(peer, "aud-a", "reader-1", NixlAgent("aud-reader-1"))
        status(lambda: introduce(peer, "aud-a", "reader-2", NixlAgent("aud-reader-2")))  # over max_readers_per_engine
        peer.RenewLeases(pb.RenewLeaseRequest(engine_id="aud-a", request_ids=["x", "y"], lease_s=1), timeout=10)
        peer.GetIncarnation(pb.IncarnationRequest(engine_id="aud-a"), timeout=10)  # an answered probe: no line
        status(lambda: peer.GetIncarnation(pb.IncarnationRequest(engine_id="nobody"), timeout=10))
        lines = [json.loads(line) for line in daemon.tail(200_000).splitlines()
                 if line.startswith("{") and '"kvxferd.audit"' in line]
        got = [(r["method"], r["outcome"], r.get("reader", ""), r.get("num_request_ids", 0)) for r in lines]
        assert got == [("GetEngineInfo", "OK", "reader-1/0", 0),
                       ("GetEngineInfo", "RESOURCE_EXHAUSTED", "reader-2/0", 0),
                       ("RenewLeases", "OK", "", 2), ("GetIncarnation", "NOT_FOUND", "", 0)], got
        assert all(r["peer"].startswith("ipv4:127.0.0.1:") and r["identity"] == "" for r in lines)  # no TLS here
        assert "max_readers_per_engine" in lines[1]["error"]
    finally:
        with contextlib.suppress(Exception):  # a registration that failed has nothing to deregister
            client.deregister()
        client.close()
        daemon.terminate()  # always: a daemon left running outlives the test run
        for arena in arenas:
            arena.close()
