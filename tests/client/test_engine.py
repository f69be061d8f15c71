"""The engine client's session switch, in-process: a stream that was replaced (reconnect, or a new
registration) must not hand the session anything more, whatever its thread was doing at the time; and
the control side's heartbeat registers again only when nobody did meanwhile."""

import queue
import threading

import grpc

from kvxferd.client.engine import EngineClient
from kvxferd.client.session import ACK_EVERY, ReadSession
from kvxferd.proto.v1 import kvxfer_pb2 as pb


class ScriptedStream:
    """Yields completion batches; ``before(n)`` runs just before batch ``n`` is handed over."""

    def __init__(self, batches, before=None, error: grpc.RpcError | None = None) -> None:
        self.batches, self.before, self.error, self.cancelled = batches, before or {}, error, False

    def __iter__(self):
        for n, batch in enumerate(self.batches):
            if n in self.before:
                self.before[n]()
            yield batch
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class Aborted(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.ABORTED


def _batch(*seqs: int) -> pb.CompletionBatch:
    return pb.CompletionBatch(completions=[pb.Completion(request_id=f"r{s}", seq=s, ok=True) for s in seqs])


def _client() -> EngineClient:
    client = EngineClient("unix:/nonexistent/kvxferd.sock")  # the channel connects lazily: never here
    client.reads._outbox = queue.SimpleQueue()
    return client


def _session() -> ReadSession:
    return _client().reads


def _retire(session: ReadSession) -> None:
    """What a new registration does first, from another thread (as the heartbeat would)."""
    def body():
        with session._cond:
            session._retire_stream()
            session._last_seq = session._acked_seq = 0
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()


def test_a_retired_stream_hands_over_nothing_more():
    session = _session()
    stream = ScriptedStream([_batch(1, 2), _batch(3)], before={1: lambda: _retire(session)})
    session._stream = stream
    session._watch(stream)
    assert stream.cancelled
    assert set(session._completions) == {"r1", "r2"}  # r3 comes again on the next stream (unacked)
    assert session._last_seq == 0  # the new registration's numbering was left alone


def test_a_retired_stream_sends_no_ack_and_reports_no_error():
    session = _session()
    seqs = list(range(1, ACK_EVERY + 1))
    stream = ScriptedStream([_batch(*seqs)], before={0: lambda: _retire(session)}, error=Aborted())
    session._stream = stream
    session._watch(stream)
    assert session._outbox.empty() and session.stream_error is None and session._completions == {}


def test_the_current_stream_acks_and_reports_its_end():
    session = _session()
    seqs = list(range(1, ACK_EVERY + 1))
    stream = ScriptedStream([_batch(*seqs)], error=Aborted())
    session._stream = stream
    session._watch(stream)
    assert session._outbox.get_nowait().ack_seq == ACK_EVERY
    assert session.stream_error is not None and session.stream_error.code() == grpc.StatusCode.ABORTED
    assert len(session._completions) == ACK_EVERY


class NotFound(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND


class RestartedDaemon:
    """A daemon that restarted: the heartbeat sent before the engine registered again is answered
    NOT_FOUND only after that registration went through (``during_heartbeat`` stands for it)."""

    def __init__(self, during_heartbeat) -> None:
        self.during_heartbeat, self.registrations = during_heartbeat, []

    def Heartbeat(self, request, timeout):
        self.during_heartbeat()
        raise NotFound()

    def Register(self, request, timeout):
        self.registrations.append(request.engine.engine_id)
        return pb.RegisterReply(session=f"s{len(self.registrations)}", incarnation=f"i{len(self.registrations)}")


def test_a_heartbeat_does_not_replace_a_registration_made_while_it_was_out():
    """The soak's lost-stream flake: after a daemon restart the engine registered again, and the heartbeat
    that had found the old registration gone registered once more, replacing the fresh registration and
    ending the stream its next read was on. It must register again only if nobody did meanwhile."""
    client = _client()
    client.reads.open = lambda: None  # no stream in this test
    engine = pb.EngineRank(engine_id="e")
    client._register_request = pb.RegisterRequest(engine=engine)
    client.stub = RestartedDaemon(lambda: client._send_register(client._register_request))  # the engine's own
    client._stop.wait = lambda interval_s, calls=iter([False, True]): next(calls)  # one heartbeat, then stop
    client._heartbeat(0.0)
    assert client.stub.registrations == ["e"] and client.num_reregistrations == 0  # the engine's, only
    client.stub = RestartedDaemon(lambda: None)  # nobody registers meanwhile: the heartbeat does
    client._stop.wait = lambda interval_s, calls=iter([False, True]): next(calls)
    client._heartbeat(0.0)
    assert client.stub.registrations == ["e"] and client.num_reregistrations == 1


class TimedDaemon:
    """Records the timeout each Register was sent with."""

    def __init__(self) -> None:
        self.timeouts_s: list[float] = []

    def Register(self, request, timeout):  # noqa: N802 (the stub's name)
        self.timeouts_s.append(timeout)
        return pb.RegisterReply(session="s", incarnation="i")


def test_register_waits_its_own_timeout_and_other_calls_theirs():
    """CI's link-cut flake: a loaded machine took over 2 s to register (map, NIXL, a worker started); the
    soak engine gave up after its 2 s RPC timeout, the daemon registered anyway, and every retry was refused
    ALREADY_EXISTS until that lease ran out. Register has its own, longer timeout; re-registering too."""
    client = EngineClient("unix:/nonexistent/kvxferd.sock", timeout_s=2.0, register_timeout_s=30.0)
    client.reads.open = lambda: None
    client.stub = TimedDaemon()
    client._send_register(pb.RegisterRequest(engine=pb.EngineRank(engine_id="e")))
    client._send_register(pb.RegisterRequest(engine=pb.EngineRank(engine_id="e")), again=True)
    assert client.stub.timeouts_s == [30.0, 30.0]
    plain = EngineClient("unix:/nonexistent/kvxferd.sock", timeout_s=2.0)  # control: the default is timeout_s
    plain.reads.open = lambda: None
    plain.stub = TimedDaemon()
    plain._send_register(pb.RegisterRequest(engine=pb.EngineRank(engine_id="e")))
    assert plain.stub.timeouts_s == [2.0]
