"""An engine's read session: reads out, numbered completions back, holds on the same socket.

One session per registration, on one transport at a time::

    reads socket (<engine_socket>.reads)   a local daemon that offers it: batches and holds
    gRPC Reads stream                      any other daemon (engine_tcp), or no socket

Reads go in batches (:meth:`ReadSession.submit_reads`: one message per
engine step, no reply to wait for); their completions come back numbered.
The session acks what it has in its next batch (or every ``ACK_EVERY``
completions), and after a broken transport :meth:`ReadSession.open` gets
every unacked completion again, dropping the ones it already has: none
lost, none twice. Reads sent on a registration that was replaced never
complete: :meth:`ReadSession.take_lost` names them. A read the daemon
refuses comes back as a completion with ``refused_code`` set.

Registration, heartbeats and the unary calls are the control side
(:class:`kvxferd.client.engine.EngineClient`), which opens a new session
at every registration.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import grpc

from kvxferd.client.readsock import ReadsSocketError, ReadsSocketStream, hold_error
from kvxferd.errors import PermissionDeniedError
from kvxferd.proto.v1 import kvxfer_pb2 as pb

ACK_EVERY = 64  # completions received before an ack-only batch (acks ride on read batches otherwise)
REOPEN_MIN_S, REOPEN_MAX_S = 0.02, 2.0  # waits before a broken reads socket's session is opened again
REOPEN_QUIET_S = 10.0  # a break this long after the last starts the waits over


class Held(NamedTuple):
    """A placed hold: the registration holding it, and the capability its readers must present."""

    incarnation: str
    capability: bytes
    digests: bytes = b""  # with want_digests: the holder rank's digests of the held blocks (issue #59)


class LostRead(TimeoutError):
    """A read's registration went away with it (its daemon restarted): no completion will come."""


class Registration(Protocol):
    """What a session needs of its engine client (:class:`kvxferd.client.engine.EngineClient`): the
    current registration, the stub, the transport settings, and a thread that stops with the client."""

    engine_id: str | None
    session: str  # the registration's session (the reads socket's first frame carries it)
    stub: object
    reads_socket_path: str | None
    timeout_s: float
    max_message_bytes: int
    daemon_uid: int

    def start_thread(self, target: Callable[[], None]) -> None: ...


def _batches(first: pb.ReadBatch, outbox: queue.SimpleQueue):
    """What the Reads stream sends: the opening batch, then whatever is put in the outbox until None."""
    yield first
    while (batch := outbox.get()) is not None:
        yield batch


class ReadSession:
    """The reads and completions of one engine client's registrations (one transport at a time)."""

    def __init__(self, client: Registration) -> None:
        self.client = client  # its registration (engine id, session), stub and settings
        self._cond = threading.Condition()  # everything below; waits for completions and hold answers
        self._stream = None  # the current transport's stream (a ReadsSocketStream, or a gRPC call)
        self.stream_error: grpc.RpcError | None = None
        self._outbox: queue.SimpleQueue | ReadsSocketStream | None = None  # where batches go
        self._last_seq = self._acked_seq = 0  # completions had / acked on this registration
        self._pending: dict[str, pb.ReadSpec] = {}  # sent, no completion yet
        self._lost: set[str] = set()  # pending when the registration was replaced: no completion will come
        self._completions: dict[str, tuple[pb.Completion, float]] = {}
        self._hold_answers: dict[str, pb.HoldAnswer | None] = {}  # holds sent on the reads socket -> answer
        self.num_duplicates_dropped = 0  # completions sent again after a reconnect that this client had
        self.num_reopened = 0  # sessions opened again after the reads socket broke (_reopen_after_break)
        self._reopen_wait_s, self._last_break_s = 0.0, -1e9
        self._closed = False

    # ---- transport ----------------------------------------------------------------
    def restart(self) -> None:
        """A new registration: numbering starts again at 1, and reads of the old one are lost."""
        with self._cond:
            self._retire_stream()  # in the lock: its thread must not number the new registration's seqs
            self._last_seq = self._acked_seq = 0
            self._lost.update(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        self.open()

    def _retire_stream(self) -> None:
        """Cancel the current stream; call with ``_cond`` held. From here its thread neither takes
        completions nor acks (what it had not handed over comes again on the next stream) nor
        reports its end: ``_watch`` checks under this lock that its stream is still the current one."""
        if self._stream is not None:
            self._stream.cancel()
        self._stream, self.stream_error = None, None

    def open(self, *, socket_only: bool = False) -> None:
        """Open a new transport (after a broken one too); unacked completions come again, deduplicated.
        ``socket_only``: the reads socket or nothing (its error then is the stream's): a session that broke
        there does not fall back to gRPC, whose channel the client may be closing meanwhile."""
        client = self.client
        socket_stream = None
        with self._cond:
            if self._closed:
                return
            self._retire_stream()
            if self._outbox is not None:
                self._outbox.put(None)  # ends the old request iterator
            # submit_reads puts under this lock too: a batch goes on the old stream or into `first`.
            self._outbox = outbox = queue.SimpleQueue()
            # Reads whose batch may have been lost with the old stream go again, marked: the daemon
            # skips those it has (in flight or completed but not acked), so none runs twice.
            first = pb.ReadBatch(engine_id=client.engine_id, ack_seq=self._last_seq, reads=self._pending.values())
            for spec in first.reads:
                spec.resend = True
            self._acked_seq = self._last_seq
            if client.reads_socket_path and os.path.exists(client.reads_socket_path):
                first.session = client.session  # what gRPC sends as metadata
                try:
                    socket_stream = ReadsSocketStream(client.reads_socket_path, first, timeout_s=client.timeout_s,
                                                      max_frame_bytes=client.max_message_bytes,
                                                      on_holds=self._hold_answers_arrived,
                                                      daemon_uid=client.daemon_uid)
                except PermissionDeniedError as err:  # another user listens there: nothing was sent
                    self._outbox = None  # reads are refused (submit_reads), waits end at once
                    self.stream_error = ReadsSocketError(grpc.StatusCode.PERMISSION_DENIED, str(err))
                    self._cond.notify_all()
                    return
                if socket_stream.connected:  # else (a stale path, say) the gRPC stream
                    self._outbox = self._stream = socket_stream  # in the lock: later batches go after `first`
                elif socket_only:
                    self.stream_error = socket_stream.error
                    self._cond.notify_all()
                    return
                else:
                    socket_stream = None
                    first.session = ""
            elif socket_only:
                self.stream_error = ReadsSocketError(grpc.StatusCode.UNAVAILABLE, "the reads socket is gone")
                self._cond.notify_all()
                return
        if socket_stream is not None:
            client.start_thread(lambda: self._watch(socket_stream))
            return
        stream = client.stub.Reads(_batches(first, outbox))
        with self._cond:
            self._stream = stream
        client.start_thread(lambda: self._watch(stream))

    @property
    def on_socket(self) -> bool:
        """The current transport is the daemon's reads socket."""
        return isinstance(self._stream, ReadsSocketStream)

    def _watch(self, stream) -> None:
        try:
            for item in stream:
                with self._cond:
                    if stream is not self._stream:
                        break  # retired: see _retire_stream
                    for completion in item.completions:
                        if completion.seq and completion.seq <= self._last_seq:
                            self.num_duplicates_dropped += 1  # sent again after a reconnect; this client has it
                            continue
                        self._last_seq = max(self._last_seq, completion.seq)
                        self._pending.pop(completion.request_id, None)
                        self._completions[completion.request_id] = (completion, time.time())
                    self._cond.notify_all()
                    if self._last_seq - self._acked_seq >= ACK_EVERY:
                        self._acked_seq = self._last_seq
                        self._outbox.put(pb.ReadBatch(ack_seq=self._acked_seq))
        except ReadsSocketError as err:
            if err.broken and self._reopen_after_break(stream):
                return
            with self._cond:
                if err.code() != grpc.StatusCode.CANCELLED and stream is self._stream:
                    self.stream_error = err
        except grpc.RpcError as err:
            with self._cond:
                if err.code() != grpc.StatusCode.CANCELLED and stream is self._stream:
                    self.stream_error = err
        except PermissionDeniedError as err:  # the stream was never opened: a foreign socket (nothing sent)
            with self._cond:
                if stream is self._stream:
                    self.stream_error = ReadsSocketError(grpc.StatusCode.PERMISSION_DENIED, str(err))
        with self._cond:
            self._cond.notify_all()

    def _reopen_after_break(self, stream) -> bool:
        """The reads socket closed without the daemon's last word: the reader worker that served the
        session died or was replaced (the daemon itself would have said why it ends one). Open a new
        session on the same registration: unacked completions come again and the reads without one are
        sent again (``resend``), so none is lost. Breaks in a row wait longer (REOPEN_MIN_S doubling to
        REOPEN_MAX_S); True when a new session was opened. A daemon that is gone refuses it: that
        session's error is the stream's, as before."""
        now = time.monotonic()
        with self._cond:
            if stream is not self._stream:
                return True  # retired meanwhile: whoever retired it opened the next
            self._reopen_wait_s = (min(2 * self._reopen_wait_s, REOPEN_MAX_S)
                                   if now - self._last_break_s < REOPEN_QUIET_S else REOPEN_MIN_S)
            self._last_break_s = now
            wait_s = self._reopen_wait_s
        time.sleep(wait_s)
        with self._cond:
            if stream is not self._stream or self._closed:
                return True
            self.num_reopened += 1
        self.open(socket_only=True)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True  # no session opened again after a break from here on
        if self._stream is not None:
            self._stream.cancel()
        if self._outbox is not None:
            self._outbox.put(None)

    # ---- reads and completions ------------------------------------------------------
    def submit_reads(self, reads: Sequence[pb.ReadSpec]) -> None:
        """Send a batch of reads; never blocks. Refusals come back as completions."""
        if self.stream_error is not None and self._outbox is None:
            raise PermissionDeniedError("daemon_uid", self.stream_error.details())
        if self._outbox is None:
            raise RuntimeError("submit_reads needs a registered client (its session is opened at Register)")
        with self._cond:
            ack = self._acked_seq = self._last_seq
            for spec in reads:
                self._pending[spec.request_id] = spec
            self._outbox.put(pb.ReadBatch(reads=reads, ack_seq=ack))

    def wait_completion(self, request_id: str, timeout_s: float = 30.0) -> pb.Completion:
        """The completion of ``request_id`` (see :meth:`wait_completion_timed`)."""
        return self.wait_completion_timed(request_id, timeout_s)[0]

    def wait_completion_timed(self, request_id: str, timeout_s: float = 30.0) -> tuple[pb.Completion, float]:
        """The completion of ``request_id`` and the wall-clock time it arrived (raises ``TimeoutError``,
        :class:`LostRead` when its registration was replaced)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._completions:
                if request_id in self._lost:
                    self._lost.discard(request_id)
                    raise LostRead(f"{request_id!r} was in flight when this rank registered again")
                left = deadline - time.monotonic()
                if left <= 0 or self.stream_error is not None:
                    raise TimeoutError(f"no completion for {request_id!r} after {timeout_s:g} s"
                                       + (f" (stream: {self.stream_error.code().name})" if self.stream_error else ""))
                self._cond.wait(left)
            return self._completions.pop(request_id)

    def take_completions(self) -> list[pb.Completion]:
        """Every completion that arrived and was not taken yet (never blocks)."""
        return [completion for completion, _ in self.take_completions_timed()]

    def take_completions_timed(self) -> list[tuple[pb.Completion, float]]:
        """:meth:`take_completions`, each with the wall-clock time it arrived here."""
        with self._cond:
            taken = list(self._completions.values())
            self._completions.clear()
        return taken

    def take_lost(self) -> set[str]:
        """Reads sent on a registration that was replaced since (they will never complete), once each."""
        with self._cond:
            lost, self._lost = self._lost, set()
        return lost

    # ---- holds on the reads socket ----------------------------------------------------
    def hold(self, request: pb.HoldRequest) -> Held | None:
        """Place a hold on the reads socket and wait for its answer; None when the session is not on the
        socket (or a hold of that id is already waiting there): the caller uses the ``Hold`` call."""
        with self._cond:
            stream = self._stream
            if not isinstance(stream, ReadsSocketStream) or request.request_id in self._hold_answers:
                return None
            self._hold_answers[request.request_id] = None
            stream.put(pb.ReadBatch(holds=[request]))
        return self._hold_answer(stream, request.request_id)

    def final_layers(self, request: pb.FinalLayersRequest) -> bool:
        """Send a FinalLayers call on the reads socket (not answered); False when the session is not there."""
        with self._cond:
            stream = self._stream
            if not isinstance(stream, ReadsSocketStream):
                return False
            stream.put(pb.ReadBatch(final_layers=[request]))
        return True

    def _hold_answer(self, stream: ReadsSocketStream, request_id: str) -> Held:
        deadline = time.monotonic() + self.client.timeout_s
        with self._cond:
            try:
                while (answer := self._hold_answers[request_id]) is None:
                    left = deadline - time.monotonic()
                    if stream is not self._stream or self.stream_error is not None or left <= 0:
                        raise ReadsSocketError(grpc.StatusCode.UNAVAILABLE if left > 0 else
                                               grpc.StatusCode.DEADLINE_EXCEEDED,
                                               f"request_id: the reads session ended before the hold of "
                                               f"{request_id!r} was answered (it may or may not be held)")
                    self._cond.wait(left)
            finally:
                self._hold_answers.pop(request_id, None)
        if (error := hold_error(answer)) is not None:
            raise error
        return Held(answer.incarnation, answer.capability, answer.digests)

    def _hold_answers_arrived(self, answers) -> None:
        """The reads socket's reader thread: answers to holds sent on it."""
        with self._cond:
            for answer in answers:
                if answer.request_id in self._hold_answers:
                    self._hold_answers[answer.request_id] = answer
            self._cond.notify_all()
