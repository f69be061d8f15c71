"""The rules of a read hold on every transport an engine may send it over, against real daemons.

An engine's reads reach its daemon over the reads socket (the default for a local daemon) or the gRPC
``Reads`` stream (the unary ``SubmitRead`` and ``WatchCompletions`` were retired in engine protocol 2).
The daemon checks them in one place, and both send a refusal back as a completion naming the status
(``refused_code``). What an engine relies on must not depend
on which one it uses: an ok read is byte-exact and completes exactly once, numbered; out-of-range
local block ids are refused INVALID_ARGUMENT with nothing written; a request id is refused while a
read of it is in flight and free again once its completion arrived; a read of a released hold fails
stale, writing nothing; a remote engine without a handshake is refused NOT_FOUND. So the rules are
written once, here, and every test runs on each transport (``submit`` hides how each one reports);
a rule that held on one transport only would fail here on the others.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import replace
from typing import NamedTuple

import grpc
import pytest

from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.wire.messages import ids_from_pb
from tests.service.helpers import CODES, GQA_GROUPS as GROUPS, ProxyPeer, two_block_request

C = grpc.StatusCode
TRANSPORTS = ("socket", "grpc")


class GatedPeer(ProxyPeer):
    """The prefill daemon's peer service, forwarded; while the gate is shut, GetEngineInfo waits. The decode
    daemon's link is then mid-handshake, so a read on it is accepted and waits for the handshake: in flight
    for as long as the test keeps the gate shut, whatever the machine's speed."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.opened, self.waiting = threading.Event(), threading.Event()
        self.opened.set()

    def shut(self) -> None:
        self.waiting.clear()
        self.opened.clear()

    def _forward(self, method: str, request, context):
        try:
            return getattr(self.stub, method)(request, timeout=10)
        except grpc.RpcError as err:
            context.abort(err.code(), err.details())

    def GetEngineInfo(self, request, context):
        if not self.opened.is_set():
            self.waiting.set()
            self.opened.wait(30)
        return self._forward("GetEngineInfo", request, context)

    def GetIncarnation(self, request, context):
        return self._forward("GetIncarnation", request, context)

    def RenewLeases(self, request, context):
        return self._forward("RenewLeases", request, context)


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="tx") as c:
        yield c


@pytest.fixture(scope="module")
def gate(cluster):
    """The decode engine's link to the prefill engine, through a :class:`GatedPeer` (open)."""
    peer = GatedPeer(cluster.prefill_daemons[0].peer_address)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    peer_grpc.add_PeerServiceServicer_to_server(peer, server)
    peer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        cluster.decode_clients[0].handshake(cluster.prefill_id, [peer.address])
        yield peer
    finally:
        peer.opened.set()
        cluster.handshake()  # the prefill daemon's own address again
        server.stop(0)


def _quiet(client, quiet_s: float = 0.5, timeout_s: float = 10.0) -> list[pb.Completion]:
    """Every completion that arrives until none has come for ``quiet_s``."""
    seen, last_news, deadline = [], time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - last_news < quiet_s and time.monotonic() < deadline:
        if news := client.reads.take_completions():
            seen += news
            last_news = time.monotonic()
        time.sleep(0.02)
    return seen


@pytest.fixture(params=TRANSPORTS)
def decode(cluster, request):
    """(transport, the decode client on it), with nothing left over from the tests before and the
    decode cache reset."""
    client, transport = cluster.decode_clients[0], request.param
    socket_path = client.reads_socket_path
    client.reads_socket_path = socket_path if transport == "socket" else None
    try:
        client.reconnect_reads()
        assert client.reads.on_socket == (transport == "socket")
        _quiet(client)  # completions not acked before come again (the client drops them)
        client.reads.submit_reads([])  # acks them
        cluster.reset_decode()
        yield transport, client
    finally:
        client.reads_socket_path = socket_path
        client.reconnect_reads()


class Outcome(NamedTuple):
    code: grpc.StatusCode | None  # the refusal's status: the completion's refused_code
    completion: pb.Completion | None  # None: not waited for
    error: str  # the completion's error


def submit(cluster, transport: str, client, request: ReadRequest, *, remote_engine_id: str | None = None,
           wait: bool = True) -> Outcome:
    """Send one read of ``request`` on ``transport``, with its hold's capabilities; with ``wait``, its outcome."""
    args = (request.request_id, remote_engine_id or cluster.prefill_id, request.remote_request_id,
            request.local_block_ids, request.remote_block_ids)
    kwargs = dict(num_tokens=request.num_tokens or 0,
                  remote_capabilities=cluster.capabilities.get(request.remote_request_id, ()))
    client.reads.submit_reads([client.read_spec(*args, **kwargs)])
    if not wait:
        return Outcome(None, None, "")
    completion = client.reads.wait_completion(request.request_id, 30.0)
    return Outcome(CODES[completion.refused_code] if completion.refused_code else None, completion, completion.error)


def _request(transport: str, name: str, k: int) -> ReadRequest:
    return two_block_request(f"{transport}-{name}", k)  # request ids of one module cluster: one per transport


def _refused(outcome: Outcome, code: grpc.StatusCode) -> None:
    """Refused with ``code``: a completion that is not ok and names the code."""
    assert outcome.code == code, outcome
    assert not outcome.completion.ok and outcome.completion.refused_code == code.value[0], outcome.completion


def test_an_ok_read_is_byte_exact_and_completes_once_numbered(cluster, decode):
    transport, client = decode
    duplicates, seqs, ids = client.reads.num_duplicates_dropped, [], set()
    for k in (1, 2):
        request = _request(transport, f"ok{k}", k)
        cluster.hold(request)
        assert cluster.decode_untouched()
        code, completion, error = submit(cluster, transport, client, request)
        assert code is None and completion.ok and completion.refused_code == 0, error
        assert completion.request_id == request.request_id and completion.num_bytes > 0
        assert cluster.check(request) == []  # byte-exact, against the oracle
        assert not cluster.decode_untouched()  # the "nothing written" check of the refusals below sees a write
        cluster.reset_decode()
        seqs.append(completion.seq)
        ids.add(request.request_id)
    assert 0 < seqs[0] < seqs[1], seqs
    assert [c for c in _quiet(client) if c.request_id in ids] == []  # exactly once: nothing more came
    assert client.reads.num_duplicates_dropped == duplicates  # not even sent twice


def test_out_of_range_local_blocks_are_refused_invalid_argument_writing_nothing(cluster, decode):
    transport, client = decode
    held = _request(transport, "range", 3)
    cluster.hold(held)  # held: what is wrong is the local ids
    bad = replace(held, local_block_ids=tuple(ids + 10_000 for ids in held.local_block_ids))
    outcome = submit(cluster, transport, client, bad)
    _refused(outcome, C.INVALID_ARGUMENT)
    assert "block" in outcome.error, outcome.error
    assert cluster.decode_untouched()
    assert [c for c in _quiet(client) if c.request_id == held.request_id] == []  # no (other) completion
    # Negative control: the same request with its own ids is read, and the same check sees it.
    code, completion, error = submit(cluster, transport, client, held)
    assert code is None and completion.ok, error
    assert not cluster.decode_untouched() and cluster.check(held) == []


def test_a_request_id_is_refused_while_in_flight_and_free_again_once_completed(cluster, gate, decode):
    transport, client = decode
    first = _request(transport, "busy", 4)
    cluster.hold(first)
    gate.shut()
    with futures.ThreadPoolExecutor(1) as pool:
        handshake = pool.submit(client.handshake, cluster.prefill_id, [gate.address])
        try:
            assert gate.waiting.wait(20), "the decode daemon never asked for the engine info"
            assert submit(cluster, transport, client, first, wait=False).code is None  # accepted; waits
            again = submit(cluster, transport, client, first)
        finally:
            gate.opened.set()
        handshake.result(30)
    _refused(again, C.INVALID_ARGUMENT)
    assert "already in flight" in again.error, again.error
    completion = client.reads.wait_completion(first.request_id, 30.0)  # the first read, once the link is ready
    assert completion.ok and completion.refused_code == 0, completion.error
    assert cluster.check(first) == []
    cluster.reset_decode()
    # Its completion arrived: the id may be used again (for another hold's read).
    reused = replace(first, remote_request_id=f"{first.remote_request_id}-again")
    cluster.hold(reused)
    code, completion, error = submit(cluster, transport, client, reused)
    assert code is None and completion.ok, error
    assert cluster.check(reused) == []


def test_a_read_of_a_released_hold_fails_stale_writing_nothing(cluster, decode):
    transport, client = decode
    request = _request(transport, "released", 5)
    cluster.hold(request)
    cluster.prefill_clients[0].release(request.remote_request_id)  # prefill dropped the request
    code, completion, error = submit(cluster, transport, client, request)
    assert code is None and completion is not None, error  # accepted: the hold ends up checked on the board
    assert not completion.ok and "stale" in completion.error, completion
    invalid = ids_from_pb(completion.invalid_block_ids)
    assert len(invalid) == len(request.local_block_ids)
    for got, local in zip(invalid, request.local_block_ids):
        assert set(local.tolist()) <= set(got.tolist()), (got, local)
    assert cluster.decode_untouched()


def test_a_remote_engine_without_a_handshake_is_refused_not_found(cluster, decode):
    transport, client = decode
    request = _request(transport, "nobody", 6)
    outcome = submit(cluster, transport, client, request, remote_engine_id="nobody")
    _refused(outcome, C.NOT_FOUND)
    assert "nobody" in outcome.error, outcome.error
    assert cluster.decode_untouched()


def test_the_retired_unary_calls_are_unimplemented_for_a_raw_client(cluster):
    """Issue 61, item 1 (engine protocol 2): ``WatchCompletions`` and ``SubmitRead`` are gone, so no
    completion stream can end OK when its registration ends; a client that still calls them hears
    UNIMPLEMENTED. Raw calls by method path, bytes in and out: no kvxferd code on the client's side."""
    target = cluster.decode_daemons[0].engine_target
    with grpc.insecure_channel(target) as channel:
        codes = {}
        for method in ("SubmitRead", "WatchCompletions", "Heartbeat"):
            call = channel.unary_unary(f"/kvxfer.v1.EngineService/{method}", request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(b"", timeout=10)
            codes[method] = err.value.code()
    assert codes["SubmitRead"] == codes["WatchCompletions"] == C.UNIMPLEMENTED
    assert codes["Heartbeat"] != C.UNIMPLEMENTED  # the control: a live method answers (here, without a session)
