"""The reads socket against real daemons: a local engine's reads go over it byte-exact, and whatever
arrives on it that is not a well-formed session of a registered engine ends that session with a
status and why, leaving the daemon and the engine's own session working."""

import os
import socket
import stat
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.wire.frames import HEADER, encode_frame, reads_socket_path
from tests.service.helpers import GQA_GROUPS as GROUPS, engine_pb, frame, raw_session, two_block_request

C = grpc.StatusCode
MAX_READS, MAX_BATCH, HELLO_S = 8, 10, 0.5


@pytest.fixture(scope="module")
def cluster(workdir):
    args = ("--max-reads-per-engine", str(MAX_READS), "--max-reads-per-batch", str(MAX_BATCH),
            "--fd-recv-timeout-s", str(HELLO_S))
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="rsock", daemon_args=args) as c:
        yield c


def _path(cluster, side: str = "decode") -> str:
    daemon = cluster.decode_daemons[0] if side == "decode" else cluster.prefill_daemons[0]
    return reads_socket_path(daemon.engine_target.removeprefix("unix:"))


def _spec(cluster, request: ReadRequest) -> pb.ReadSpec:
    return cluster.decode_clients[0].read_spec(request.request_id, cluster.prefill_id, request.remote_request_id,
                                               request.local_block_ids, request.remote_block_ids, num_tokens=32,
                                               remote_capabilities=cluster.capabilities.get(request.remote_request_id, ()))


def _session(cluster, raw_frames: list[bytes], timeout_s: float = 10.0,
             path: str | None = None) -> tuple[list[pb.Completion], int, str]:
    """Send raw frames on a new connection, then read until the daemon closes it: the completions, and the
    end frame's code and message (0 and "" if it closed without one)."""
    batches, code, message = raw_session(path or _path(cluster), raw_frames, timeout_s)
    return [c for batch in batches for c in batch.completions], code, message


_frame = frame


def test_a_local_engine_reads_over_the_socket_byte_exact(cluster):
    client = cluster.decode_clients[0]
    assert isinstance(client.reads._stream, ReadsSocketStream)
    mode = stat.S_IMODE(os.stat(_path(cluster)).st_mode)
    assert mode == 0o600, oct(mode)  # as the engine socket: the daemon's user (and allowed uids) only
    requests = [two_block_request(f"sock{n}", n) for n in range(4)]
    results = [cluster.read(request) for request in requests]
    assert all(r.ok for rs in results for r in rs)
    cluster.reset_decode()


def test_what_is_not_a_session_of_a_registered_engine_ends_with_a_status(cluster):
    decode_id = cluster.decode_id
    cases = [  # what arrives, the code, a word of the message
        ([encode_frame(b"\x0a\xff")], C.INVALID_ARGUMENT, "not a ReadBatch"),
        ([HEADER.pack(1 << 31)], C.RESOURCE_EXHAUSTED, "the limit is"),  # refused before it is buffered
        ([_frame(pb.ReadBatch(engine_id=decode_id))], C.UNAUTHENTICATED, "no valid session"),
        ([_frame(pb.ReadBatch(engine_id=decode_id, session="guess"))], C.UNAUTHENTICATED, "no valid session"),
        ([_frame(pb.ReadBatch(engine_id="nobody", session="x"))], C.NOT_FOUND, "nobody"),
        ([_frame(pb.ReadBatch(engine_id="bad\x00id"))], C.INVALID_ARGUMENT, "printable"),
        ([], C.INVALID_ARGUMENT, "no first batch"),  # silent: HELLO_S, then ended
        ([encode_frame(b"\x0a")[:3]], C.INVALID_ARGUMENT, "no first batch"),  # half a header, then silence
    ]
    for frames, code, text in cases:
        start = time.monotonic()
        got, end_code, message = _session(cluster, frames)
        assert (got, end_code) == ([], code.value[0]) and text in message, (text, end_code, message)
        assert time.monotonic() - start < HELLO_S + 5
    assert cluster.read(two_block_request("after-bad", 5))[0].ok  # the daemon and the engine's session go on
    cluster.reset_decode()


def test_a_session_breaking_a_rule_ends_and_the_engine_reconnects_losing_nothing(cluster):
    """With the engine's real session: a batch over max_reads_per_batch ends the raw session (which took the
    completions over from the client's); the client reconnects and reads on."""
    client = cluster.decode_clients[0]
    hello = pb.ReadBatch(engine_id=cluster.decode_id, session=client.session)
    too_many = pb.ReadBatch(reads=[_spec(cluster, two_block_request("many", 1))] * (MAX_BATCH + 1))
    got, end_code, message = _session(cluster, [_frame(hello), _frame(too_many)])
    assert end_code == C.INVALID_ARGUMENT.value[0] and "max_reads_per_batch" in message, message
    time.sleep(0.05)
    assert client.reads.stream_error is not None and client.reads.stream_error.code() == C.ABORTED  # it was taken over
    client.reconnect_reads()
    assert cluster.read(two_block_request("after-rule", 6))[0].ok
    cluster.reset_decode()


def test_a_session_that_never_acks_is_bounded_and_a_new_one_gets_everything_once(cluster):
    client = cluster.decode_clients[0]
    client.reads.submit_reads([])  # acks what the tests before read: none of it counts against MAX_READS
    time.sleep(0.1)
    requests = [two_block_request(f"quiet{n}", n) for n in range(3 * MAX_READS)]
    for request in requests:
        cluster.hold(request)
    frames = [_frame(pb.ReadBatch(engine_id=cluster.decode_id, session=client.session))]
    frames += [_frame(pb.ReadBatch(reads=[_spec(cluster, r) for r in requests[i:i + 3]]))
               for i in range(0, len(requests), 3)]
    got, end_code, message = _session(cluster, frames)
    assert end_code == C.RESOURCE_EXHAUSTED.value[0] and "max_reads_per_engine" in message, message
    assert len(got) <= 2 * MAX_READS
    client.reconnect_reads()  # the client never saw these: every unacked one comes again, once
    arrived, quiet_since = [], time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        news = client.reads.take_completions()
        if news:
            arrived += news
            quiet_since = time.monotonic()
        time.sleep(0.02)
    seen = {c.request_id: c for c in arrived}
    assert len(seen) == len(arrived) and {c.request_id for c in got} <= set(seen)  # each once, none lost
    ok = [rid for rid, c in seen.items() if c.ok]
    assert len(ok) == MAX_READS, {rid: (c.ok, c.refused_code) for rid, c in seen.items()}
    for request in requests:
        if request.request_id not in ok:
            cluster.prefill_clients[0].release(request.remote_request_id)
    client.reads.submit_reads([])  # acks them
    cluster.reset_decode()
    assert cluster.read(two_block_request("after-quiet", 7))[0].ok
    cluster.reset_decode()


def test_a_daemon_without_the_socket_serves_reads_on_the_grpc_stream(workdir):
    """``--no-reads-socket`` (or a stale socket file a killed daemon left): the client uses gRPC."""
    stale = os.path.join(workdir, "nosock.sock.reads")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left_behind:
        left_behind.bind(stale)  # bound, never listening: what a SIGKILL leaves
    daemon = DaemonProcess("nosock", socket_dir=workdir, extra_args=("--no-reads-socket",))
    client = EngineClient(daemon.engine_target)
    arenas = []
    try:
        assert not os.path.exists(stale)  # the daemon removed it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left_behind:
            left_behind.bind(stale)  # and again after the start: the client must still get on
        client.register(engine_pb(GROUPS[1], "nosock-decode", arenas), lease_s=30)
        assert client.reads._stream is not None and not isinstance(client.reads._stream, ReadsSocketStream)
        client.reads.submit_reads([client.read_spec("r", "nobody", "r@p", [[1]], [[1]])])
        completion = client.reads.wait_completion("r", 10)
        assert completion.refused_code == C.NOT_FOUND.value[0]  # answered on the gRPC stream
    finally:
        client.close()
        daemon.terminate()
        for arena in arenas:
            arena.close()


def test_holds_go_over_the_socket_and_a_refused_one_is_answered_with_its_code(cluster, monkeypatch):
    prefill = cluster.prefill_clients[0]
    assert isinstance(prefill.reads._stream, ReadsSocketStream)

    def no_grpc(*args, **kwargs):
        raise AssertionError("Hold went over gRPC")

    monkeypatch.setattr(prefill.stub, "Hold", no_grpc)
    request = two_block_request("sock-hold", 13)
    held = prefill.hold(request.remote_request_id, request.remote_block_ids)
    assert held.incarnation == prefill.incarnation and len(held.capability) == 16  # as the Hold call answers
    cluster.capabilities[request.remote_request_id] = (held.capability,)
    with pytest.raises(grpc.RpcError) as refused:
        prefill.hold("sock-bad", [np.array([10_000])] * len(GROUPS[0]))
    assert refused.value.code() == C.INVALID_ARGUMENT and "block_ids" in refused.value.details()
    with pytest.raises(grpc.RpcError) as twice:  # the same id again: as the Hold call answers it
        prefill.hold(request.remote_request_id, request.remote_block_ids)
    assert twice.value.code() != C.OK and prefill.reads.stream_error is None  # answered; the session goes on
    cluster.submit(request)
    (completion,) = cluster.completions(request)  # the hold made on the socket is read and consumed
    assert completion.ok, completion.error
    event = cluster.hold_events(request)[0]
    assert event is not None and event.kind == pb.NotifyEvent.CONSUMED
    cluster.reset_decode()


def test_holds_of_another_engine_or_too_many_end_the_session(cluster):
    prefill = cluster.prefill_clients[0]
    hello = pb.ReadBatch(engine_id=cluster.prefill_id, session=prefill.session)
    hold = pb.HoldRequest(request_id="x", block_ids=[])
    cases = [(pb.ReadBatch(holds=[pb.HoldRequest(engine_id="someone-else", request_id="x")]), "engine_id"),
             (pb.ReadBatch(holds=[hold] * (MAX_BATCH + 1)), "max_reads_per_batch")]
    for batch, text in cases:
        _, end_code, message = _session(cluster, [_frame(hello), _frame(batch)], path=_path(cluster, "prefill"))
        assert end_code == C.INVALID_ARGUMENT.value[0] and text in message, message
    prefill.reconnect_reads()  # its session was taken over by the raw ones
    assert cluster.read(two_block_request("after-holds", 14))[0].ok  # holds (on the socket again) and reads
    cluster.reset_decode()
