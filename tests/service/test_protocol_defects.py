"""Issue 14: defects an outside client found, each pinned against real daemons.

Every test is named for the defect it pins; each failed before its fix.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import EngineClient
from kvxferd.wire.peerauth import peer_channel
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.service.helpers import engine_pb, refusal, second_completion_stream, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
ANSWER_S = 5.0  # every bad input is answered within this


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="def") as c:
        yield c


def read_still_works(cluster: DaemonCluster, name: str, seed: int = 0) -> None:
    """A valid transfer on the existing link is byte-exact and consumed."""
    request = random_request(name, *GROUPS, 48, np.random.default_rng(seed))
    cluster.reset_decode()
    completions = cluster.read(request, timeout_s=20)
    assert all(c.ok for c in completions), [c.error for c in completions]
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def peer_stub(address: str) -> peer_grpc.PeerServiceStub:
    return peer_grpc.PeerServiceStub(peer_channel(address))


@functools.cache
def observer() -> NixlAgent:
    """The agent a test introduces as a reader when it wants to see what a peer learns."""
    return NixlAgent("observer")


def engine_info(cluster: DaemonCluster, side: str) -> pb.EngineInfo:
    """What a peer learns of an engine rank (the reader's agent metadata included)."""
    daemon, engine_id = ((cluster.decode_daemons[0], cluster.decode_id) if side == "decode"
                         else (cluster.prefill_daemons[0], cluster.prefill_id))
    reply = peer_stub(daemon.peer_address).GetEngineInfo(
        pb.EngineInfoRequest(engine_id=engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
                             reader_engine_id="observer", reader_tp_size=1,
                             reader_agent_metadata=observer().metadata()), timeout=ANSWER_S)
    info = pb.EngineInfo()
    info.ParseFromString(reply.payload)
    return info


def introduce(cluster: DaemonCluster, reader_engine_id: str, metadata: bytes):
    stub = peer_stub(cluster.prefill_daemons[0].peer_address)
    return stub.GetEngineInfo(pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION,
                                                   tp_rank=0, reader_engine_id=reader_engine_id, reader_tp_rank=0,
                                                   reader_tp_size=1, reader_agent_metadata=metadata), timeout=ANSWER_S)


def test_defect1_bad_shm_names_are_invalid_argument_not_internal(cluster):
    stub = cluster.decode_clients[0].stub
    arenas = []
    good = engine_pb(GROUPS[1], "shm-names", arenas)
    try:
        for name in ("/", "//", "../", "/..", "a" * 300, "a\0b"):
            message = pb.EngineRank()
            message.CopyFrom(good)
            message.groups[0].regions[0].handle.shm_name = name
            code, details = status(lambda: stub.Register(pb.RegisterRequest(engine=message), timeout=ANSWER_S))
            assert code == C.INVALID_ARGUMENT, (name, code, details)
            assert details.startswith("engine.groups[0].regions[0].shm_name"), details
    finally:
        for arena in arenas:
            arena.close()


def test_defect2_undecodable_agent_name_is_invalid_argument(cluster):
    metadata = bytearray(engine_info(cluster, "decode").agent_metadata)
    at = metadata.index(b"Agent") + len(b"Agent") + 8  # the agent name's first byte
    metadata[at] = 0xD8
    code, details = status(lambda: introduce(cluster, "reader-x", bytes(metadata)))
    assert code == C.INVALID_ARGUMENT and details.startswith("reader_agent_metadata"), details
    read_still_works(cluster, "after-bad-name")


def test_defect3_handshake_with_a_repeated_address_returns_at_once(cluster):
    decode = cluster.decode_clients[0]
    for addresses in (["127.0.0.1:1", "127.0.0.1:1"], ["127.0.0.1:1"] * 20_000):
        start = time.monotonic()
        code, details = status(lambda: decode.stub.Handshake(pb.HandshakeRequest(
            engine_id=cluster.decode_id, remote_engine_id="ghost", peer_addresses=addresses), timeout=ANSWER_S))
        assert code == C.INVALID_ARGUMENT and details.startswith("peer_addresses"), details
        assert time.monotonic() - start < ANSWER_S
    # The mechanism behind the hang: two calls to one dead address at once (here from two
    # handshakes) replaced each other's channel, and the retry on a closed channel never ended.
    calls = [decode.stub.Handshake.future(pb.HandshakeRequest(engine_id=cluster.decode_id, remote_engine_id=f"ghost{n}",
                                                              peer_addresses=["127.0.0.1:1"]), timeout=ANSWER_S * 2)
             for n in range(4)]
    assert [status(call.result)[0] for call in calls] == [C.UNAVAILABLE] * 4
    read_still_works(cluster, "after-repeats")


def test_defect4_a_bad_introduction_never_disturbs_a_working_link(cluster):
    """Defect 4 was a truncated copy of a live agent's metadata replacing that agent inside NIXL. A holder
    now loads no reader's metadata (readers check the hold board; nothing is sent back to them): it reads
    the agent name from the header and refuses metadata without one. No introduction touches its agent."""
    reader = engine_info(cluster, "decode").agent_metadata
    cut = reader[: reader.index(b"MemSection") + 40]  # a live agent's metadata, cut in its memory section
    for garbage in (b"nixlSerDes|garbage", reader[:20]):
        code, details = status(lambda: introduce(cluster, "anyone", garbage))
        assert code == C.INVALID_ARGUMENT and details.startswith("reader_agent_metadata"), details
    for reader_engine_id in ("anyone", "other"):
        introduce(cluster, reader_engine_id, cut)  # the name is intact: accepted, and nothing is loaded
        read_still_works(cluster, f"after-cut-{reader_engine_id}")
    introduce(cluster, "other", NixlAgent("test-stranger").metadata())
    cluster.handshake()  # and a new handshake still succeeds
    read_still_works(cluster, "after-rehandshake")


def daemon_mappings(daemon, shm_name: str) -> int:
    with open(f"/proc/{daemon.process.pid}/maps") as maps:
        return sum(shm_name.lstrip("/") in line for line in maps)


def test_defect5_concurrent_registers_leave_no_mapping_behind(cluster):
    arenas = []
    message = engine_pb(GROUPS[1], "concurrent", arenas)
    daemon = cluster.decode_daemons[0]
    clients = [EngineClient(daemon.engine_target) for _ in range(6)]
    try:
        barrier = threading.Barrier(len(clients))

        def register(client):
            barrier.wait()
            try:
                reply = client.stub.Register(pb.RegisterRequest(engine=message), timeout=30)
            except grpc.RpcError as err:
                return err.code()
            client.session = reply.session
            return client

        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            outcomes = list(pool.map(register, clients))
        # Issue 11: one wins; the others find a live registration they hold no session of.
        (winner,) = [o for o in outcomes if isinstance(o, EngineClient)]
        assert sorted(o.name for o in outcomes if o is not winner) == ["ALREADY_EXISTS"] * (len(clients) - 1)
        assert daemon_mappings(daemon, arenas[0].name) == len(message.groups[0].regions)  # the winner's only
        winner.stub.Deregister(pb.DeregisterRequest(engine_id="concurrent"), timeout=ANSWER_S)
        assert daemon_mappings(daemon, arenas[0].name) == 0
    finally:
        for client in clients:
            client.close()
        for arena in arenas:
            arena.close()


def test_defect6_a_second_completion_stream_replaces_the_first_and_deregister_ends_it(cluster, arenas):
    code, details = second_completion_stream(cluster.decode_daemons[0].engine_target, "streams", GROUPS[1], arenas,
                                             ANSWER_S)
    assert code == C.ABORTED and "replaced" in details, details


def test_defect7_a_handshake_never_answers_with_another_calls_result(cluster):
    decode = cluster.decode_clients[0]

    def handshake(address):
        return decode.stub.Handshake.future(pb.HandshakeRequest(engine_id=cluster.decode_id,
                                                                remote_engine_id=cluster.prefill_id,
                                                                peer_addresses=[address]), timeout=20)

    a = handshake("127.0.0.1:2")
    time.sleep(0.3)
    b = handshake(cluster.prefill_daemons[0].peer_address)
    time.sleep(0.1)
    c = handshake("127.0.0.1:1")
    assert status(a.result)[0] == C.UNAVAILABLE
    assert b.result().remote_tp_size == 1
    assert status(c.result)[0] == C.UNAVAILABLE
    read_still_works(cluster, "after-joined-handshakes")  # the working addresses were kept


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 1e9])
def test_defect8_non_finite_or_unbounded_times_are_refused(cluster, value):
    decode, prefill = cluster.decode_clients[0], cluster.prefill_clients[0]
    request = random_request("times", *GROUPS, 16, np.random.default_rng(3))
    code, details = refusal(decode, "times", cluster.prefill_id, "times", request.local_block_ids,
                            request.remote_block_ids, deadline_s=value)  # a read's refusal is its completion
    assert code == C.INVALID_ARGUMENT and details.startswith("deadline_s"), details
    calls = {"lease_s": lambda: prefill.hold("times", request.remote_block_ids, lease_s=value)}
    arenas = []
    register = pb.RegisterRequest(engine=engine_pb(GROUPS[1], "times", arenas), lease_s=value)
    calls["lease_s (Register)"] = lambda: decode.stub.Register(register, timeout=ANSWER_S)
    calls["lease_s (RenewLease)"] = lambda: prefill.renew(["times"], lease_s=value)
    peer = peer_stub(cluster.prefill_daemons[0].peer_address)
    calls["lease_s (RenewLeases)"] = lambda: peer.RenewLeases(pb.RenewLeaseRequest(
        engine_id=cluster.prefill_id, request_ids=["times"], lease_s=value), timeout=ANSWER_S)
    try:
        for name, call in calls.items():
            code, details = status(call)
            assert code == C.INVALID_ARGUMENT and details.startswith(name.split()[0]), (name, details)
    finally:
        for arena in arenas:
            arena.close()


def test_defect9_duplicate_decode_block_ids_are_refused(cluster):
    decode = cluster.decode_clients[0]
    request = random_request("dups", *GROUPS, 48, np.random.default_rng(4))
    local = [np.concatenate([ids, ids[:1]]) for ids in request.local_block_ids]
    remote = [np.concatenate([ids, ids[:1]]) for ids in request.remote_block_ids]
    capability = cluster.prefill_clients[0].hold("dups", remote, lease_s=1).capability  # held: the ids are wrong
    code, details = refusal(decode, "dups", cluster.prefill_id, "dups", local, remote, num_tokens=0,
                            remote_capabilities=[capability])
    assert code == C.INVALID_ARGUMENT and "listed more than once" in details, details


def test_a_read_before_the_hold_is_refused_and_ends_nothing(cluster):
    """The docs once said such a read's notice waits for the Hold; then the daemon failed the read as stale,
    after its bytes had moved. Issue 35: without the hold's capabilities it is refused before anything is
    posted, and it sends no notice."""
    request = random_request("early", *GROUPS, 32, np.random.default_rng(6))
    (completion,) = cluster.read(request, hold=False)
    assert not completion.ok and completion.refused_code == C.PERMISSION_DENIED.value[0]
    assert "remote_capabilities" in completion.error
    cluster.hold(request, lease_s=0.5)  # a Hold that comes later is not consumed by that early read
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.EXPIRED]
