"""The Reads stream: batches in, numbered completions out; bad input, a client that stops
reading, and a broken stream that the engine reopens, against real daemons. The client's own
session runs over the reads socket and over gRPC (``decode``); the raw streams here are gRPC's
(the socket's own bad input: test_reads_socket.py)."""

import threading
import time

import grpc
import numpy as np
import pytest

from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from tests.service.helpers import GQA_GROUPS as GROUPS, two_block_request

C = grpc.StatusCode
MAX_READS = 8  # per engine, in flight or not acked (refusals count too)
MAX_BATCH = 10


@pytest.fixture(scope="module")
def cluster(workdir):
    args = ("--max-reads-per-engine", str(MAX_READS), "--max-reads-per-batch", str(MAX_BATCH))
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="rs", daemon_args=args) as c:
        yield c


def _settled_completions(client, quiet_s: float = 1.0, timeout_s: float = 15.0) -> dict:
    """Every completion that arrives until none has come for ``quiet_s``: accepted reads may still be in
    flight when a stream ends, and on a loaded machine they finish late."""
    seen, last_news, deadline = {}, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - last_news < quiet_s and time.monotonic() < deadline:
        news = client.reads.take_completions()
        if news:
            seen.update((c.request_id, c) for c in news)
            last_news = time.monotonic()
        time.sleep(0.02)
    return seen


@pytest.fixture(params=["socket", "grpc"])
def decode(cluster, request):
    """The decode client with a fresh session and nothing left unacked by the tests before: its batches on
    the daemon's reads socket (the default for a local daemon), or on the gRPC Reads stream."""
    client = cluster.decode_clients[0]
    socket_path = client.reads_socket_path
    if request.param == "grpc":
        client.reads_socket_path = None
    try:
        client.reconnect_reads()
        assert isinstance(client.reads._stream, ReadsSocketStream) == (request.param == "socket")
        _settled_completions(client)  # completions of raw streams before, sent again
        client.reads.submit_reads([])  # acks them
        yield client
    finally:
        client.reads_socket_path = socket_path


def _check_bytes(cluster, requests) -> None:
    """The decode cache holds exactly what these (disjoint, whole-block) reads wrote, checked as one request."""
    together = ReadRequest("all", "all", *(tuple(np.concatenate(ids) for ids in zip(*(getattr(r, side) for r in requests)))
                                           for side in ("local_block_ids", "remote_block_ids")), 32 * len(requests))
    assert cluster.check(together) == [], [r.request_id for r in requests]
    cluster.reset_decode()


def _spec(cluster, request: ReadRequest, **changes) -> pb.ReadSpec:
    spec = cluster.decode_clients[0].read_spec(request.request_id, cluster.prefill_id, request.remote_request_id,
                                               request.local_block_ids, request.remote_block_ids,
                                               num_tokens=request.num_tokens or 0,
                                               remote_capabilities=cluster.capabilities.get(request.remote_request_id, ()))
    for name, value in changes.items():
        setattr(spec, name, value) if not isinstance(value, list) else (spec.ClearField(name), getattr(spec, name).extend(value))
    return spec


def _exchange(stub, batches, num_completions: int, timeout_s: float = 10.0):
    """Send ``batches`` on a new Reads stream; the completions received, and the status it ended with (None: open)."""
    release = threading.Event()

    def requests():
        yield from batches
        release.wait(timeout_s)  # keep the stream open (a half-close is fine too, but not what engines do)

    call = stub.Reads(requests(), timeout=timeout_s)
    got = []
    try:
        for batch in call:
            got += batch.completions
            if len(got) >= num_completions:
                break
    except grpc.RpcError as err:
        return got, err.code(), err.details()
    finally:
        release.set()
        call.cancel()
    return got, None, ""


def test_a_batch_reads_byte_exact_and_each_refusal_names_its_read(cluster, decode):
    good = [two_block_request(f"ok{n}", n) for n in range(3)]
    for request in good:
        cluster.hold(request)
    bad_ids = _spec(cluster, two_block_request("odd", 9), local_block_ids=b"\1\0\0")  # not whole int32s
    sizes = _spec(cluster, two_block_request("sizes", 10), local_group_sizes=[1] * len(GROUPS[1]))
    nobody = _spec(cluster, two_block_request("nobody", 11), remote_engine_id="nobody")
    in_range = two_block_request(f"range{len(cluster.capabilities)}", 12)  # a new name for each parameter
    cluster.hold(in_range)  # held: what is wrong is the local ids
    out_of_range = _spec(cluster, ReadRequest("range", in_range.remote_request_id,
                                              tuple(ids + 10_000 for ids in in_range.local_block_ids),
                                              in_range.remote_block_ids, 32))
    unsealed = _spec(cluster, two_block_request("unsealed", 13))  # never held: no capability to show
    batch = pb.ReadBatch(engine_id=cluster.decode_id,
                         reads=[_spec(cluster, good[0]), bad_ids, sizes, _spec(cluster, good[1]), nobody,
                                out_of_range, unsealed, _spec(cluster, good[2])])
    got, code, _ = _exchange(decode.stub, [batch], 8)
    assert code is None
    by_id = {c.request_id: c for c in got}
    assert sorted(c.seq for c in got) == list(range(got[0].seq, got[0].seq + 8))  # numbered without gaps
    for request in good:
        assert by_id[request.request_id].ok and by_id[request.request_id].refused_code == 0
    _check_bytes(cluster, good)
    expected = {"odd": (C.INVALID_ARGUMENT, "local_block_ids"), "sizes": (C.INVALID_ARGUMENT, "local_block_ids"),
                "nobody": (C.NOT_FOUND, "remote_engine_id"), "range": (C.INVALID_ARGUMENT, "block"),
                "unsealed": (C.PERMISSION_DENIED, "remote_capabilities")}
    for request_id, (status, text) in expected.items():
        completion = by_id[request_id]
        assert not completion.ok and completion.refused_code == status.value[0] and text in completion.error, completion


def test_a_malformed_stream_ends_with_a_clear_error_and_the_session_stays_usable(cluster, decode):
    request = two_block_request("many", 1)
    too_many = pb.ReadBatch(engine_id=cluster.decode_id, reads=[_spec(cluster, request)] * (MAX_BATCH + 1))
    cases = {
        "max_reads_per_batch": [too_many],
        "engine_id": [pb.ReadBatch(engine_id=cluster.decode_id), pb.ReadBatch(engine_id="someone-else")],
        "ack_seq": [pb.ReadBatch(engine_id=cluster.decode_id, ack_seq=1 << 40)],
    }
    for text, batches in cases.items():
        _, code, details = _exchange(decode.stub, batches, 10 ** 6)  # (unacked completions of before come first)
        assert code == C.INVALID_ARGUMENT and text in details, (text, code, details)
    # no session: refused before anything is read
    raw = engine_grpc.EngineServiceStub(grpc.insecure_channel(cluster.decode_daemons[0].engine_target))
    _, code, _ = _exchange(raw, [pb.ReadBatch(engine_id=cluster.decode_id)], 10 ** 6)
    assert code == C.UNAUTHENTICATED
    decode.reconnect_reads()
    assert cluster.read(two_block_request("after", 2))[0].ok  # the engine's session still reads


def test_a_client_that_stops_reading_is_bounded_and_loses_nothing(cluster, decode):
    """Never acking: reads past the limit are refused, then the stream ends; a new stream gets everything once."""
    requests = [two_block_request(f"quiet{n}", n) for n in range(3 * MAX_READS)]
    for request in requests:
        cluster.hold(request)
    batches = [pb.ReadBatch(engine_id=cluster.decode_id)]
    batches += [pb.ReadBatch(reads=[_spec(cluster, r) for r in requests[i:i + 3]]) for i in range(0, len(requests), 3)]
    got, code, details = _exchange(decode.stub, batches, 10 ** 6)  # reads until the daemon ends the stream
    assert code == C.RESOURCE_EXHAUSTED and "max_reads_per_engine" in details, (code, details)
    assert len(got) <= 2 * MAX_READS  # what the daemon kept for this engine is bounded too
    decode.reconnect_reads()  # the client never saw these: all come again, once
    last = decode.reads.wait_completion(got[-1].request_id, 5.0)  # the last one the quiet stream saw comes again
    # wait_completion took it from the client: count it with the rest. Reads sent after the stream ended never ran.
    seen = {last.request_id: last, **_settled_completions(decode)}
    assert set(seen) <= {r.request_id for r in requests} and len(seen) >= len(got)
    ok = [rid for rid, c in seen.items() if c.ok]
    refused = [rid for rid, c in seen.items() if c.refused_code == C.RESOURCE_EXHAUSTED.value[0]]
    assert len(ok) == MAX_READS and len(ok) + len(refused) == len(seen), {r: (c.ok, c.refused_code, c.error)
                                                                          for r, c in seen.items()}
    _check_bytes(cluster, [r for r in requests if r.request_id in ok])
    for request in requests:
        if request.request_id not in ok:
            cluster.prefill_clients[0].release(request.remote_request_id)
    assert cluster.read(two_block_request("after-quiet", 3))[0].ok


def test_a_broken_stream_loses_and_duplicates_no_completion(cluster, decode):
    """Break the stream while reads complete, reopen it: every read completes exactly once."""
    requests = [two_block_request(f"brk{n}", n) for n in range(24)]
    for request in requests:
        cluster.hold(request)
    got = {}
    for i in range(0, len(requests), 4):
        # At most two batches of 4 outstanding (MAX_READS is 8): on a loaded machine reads finish
        # late, and a third batch would be refused rather than test the broken stream.
        got.update((r.request_id, decode.reads.wait_completion(r.request_id, 10.0)) for r in (requests[i - 8:i - 4] if i >= 8 else ()))
        decode.reads.submit_reads([_spec(cluster, r) for r in requests[i:i + 4]])  # acks what came
        if i == 12:
            decode.reads._stream.cancel()  # the transport breaks under the engine
            time.sleep(0.05)
            decode.reconnect_reads()  # unacked completions come again; pending reads are resent, marked
        time.sleep(0.01)
    got.update((r.request_id, decode.reads.wait_completion(r.request_id, 10.0)) for r in requests if r.request_id not in got)
    completions = [got[r.request_id] for r in requests]
    assert all(c.ok for c in completions), [c.error for c in completions if not c.ok]
    assert len({c.seq for c in completions}) == len(requests)
    assert decode.reads.take_completions() == []  # nothing extra arrived: no read ran twice
    _check_bytes(cluster, requests)
    for event in (e for r in requests for e in cluster.hold_events(r)):
        assert event is not None and event.kind == pb.NotifyEvent.CONSUMED


def test_the_end_of_a_replaced_stream_never_lands_on_the_next(cluster, decode):
    """A second stream takes the engine's completions (ABORTED for the first) and the client reopens at
    once: the first stream's error, reported while the new one opens, must not fail the new one's waits.
    (It did, about one time in ten, before the client swapped stream and error under one lock.)"""
    for n in range(30):
        refused = _spec(cluster, two_block_request(f"swap{n}", 1), remote_engine_id="nobody")
        call = decode.stub.Reads(iter([pb.ReadBatch(engine_id=cluster.decode_id, reads=[refused])]), timeout=10.0)
        assert next(iter(call)).completions  # it took over: the client's stream is ending now
        call.cancel()
        decode.reconnect_reads()
        assert not decode.reads.wait_completion(f"swap{n}", 5.0).ok  # unacked, so sent again on the new stream
        time.sleep(0.02)
        assert decode.reads.stream_error is None, n
        decode.reads.submit_reads([])  # acks it
