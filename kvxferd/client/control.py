"""A control session: holds, renewals and releases of a registration another process made, on the reads socket.

vLLM's scheduler process holds a prefill's blocks on every rank's daemon,
but its workers registered the ranks (the scheduler knows the engine id and
session from their handshake metadata). It opens one control session per
daemon instead of making gRPC calls on a request's path::

    scheduler process                          daemon (reads socket, event loop)
    connect <engine_socket>.reads ──────────►  SO_PEERCRED: an allowed uid
    ReadBatch{engine_id, session, control} ─►  the registration's session; takes no completions
    ReadBatch{holds} ───────────────────────►  place_hold, each
                               ◄────────────  CompletionBatch{holds}: one answer per hold
    ReadBatch{renewals} ────────────────────►  RenewLease, each
                               ◄────────────  CompletionBatch{renewals}: one answer per renewal, in order
    ReadBatch{releases} ────────────────────►  Release, each (no answer: the daemon takes the frames
                                               in order, so a later hold of the same id comes after)

Nothing here blocks but a wait the caller asks for: a hold's answer
(:meth:`ControlSession.hold_started` returns the wait), a renewal's (the
early holds' own thread). A session that ends fails what waits on it with the
code it ended with (``UNAVAILABLE`` when the connection broke; ``NOT_FOUND``
or ``UNAUTHENTICATED`` when the registration is gone or not this session's),
a hold's outcome then unknown, as after a broken call; the next call opens a
new session.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc

from kvxferd.client.readsock import ReadsSocketError, ReadsSocketStream, hold_error, status_of
from kvxferd.errors import PermissionDeniedError
from kvxferd.client.session import Held
from kvxferd.proto.v1 import kvxfer_pb2 as pb


class _Waiting:
    """What waits for answers on one stream: holds by request id, renewals in order."""

    def __init__(self) -> None:
        self.holds: dict[str, collections.deque[Future]] = {}
        self.renewals: collections.deque[Future] = collections.deque()

    def all(self) -> list[Future]:
        return [f for answers in self.holds.values() for f in answers] + list(self.renewals)


class ControlSession:
    """One control session with one daemon, for one registration (``engine_id``, ``session``)."""

    def __init__(self, path: str, engine_id: str, session: str, *, timeout_s: float, max_frame_bytes: int,
                 daemon_uid: int | None = None) -> None:
        self.path, self.engine_id, self.session = path, engine_id, session
        self.timeout_s, self.max_frame_bytes, self.daemon_uid = timeout_s, max_frame_bytes, daemon_uid
        self._lock = threading.Lock()  # the stream and what waits on it
        self._stream: ReadsSocketStream | None = None
        self._waiting = _Waiting()  # the current stream's
        self._closed = False

    @staticmethod
    def available(path: str | None) -> bool:
        """The daemon offers a reads socket at ``path`` (else the caller uses gRPC)."""
        return path is not None and os.path.exists(path)

    # ---- calls ------------------------------------------------------------------------
    def hold_started(self, request: pb.HoldRequest) -> Callable[[], Held]:
        """Send a hold; a function that waits for its answer and raises as the ``Hold`` call would."""
        answer: Future = Future()
        with self._lock:
            if self._ready(answer):
                self._waiting.holds.setdefault(request.request_id, collections.deque()).append(answer)
                self._stream.put(pb.ReadBatch(holds=[request]))

        def wait() -> Held:
            reply = self._result(answer, f"the hold of {request.request_id!r}")
            if (error := hold_error(reply)) is not None:
                raise error
            return Held(reply.incarnation, reply.capability, reply.digests)
        return wait

    def renew(self, request_ids: Sequence[str], lease_s: float) -> list[str]:
        """Renew holds and wait for the answer: the ids the daemon does not know."""
        answer: Future = Future()
        with self._lock:
            if self._ready(answer):
                self._waiting.renewals.append(answer)
                self._stream.put(pb.ReadBatch(renewals=[pb.RenewLeaseRequest(
                    engine_id=self.engine_id, request_ids=list(request_ids), lease_s=lease_s)]))
        reply = self._result(answer, "a lease renewal")
        if reply.code:
            raise ReadsSocketError(status_of(reply.code), reply.error)
        return list(reply.unknown_request_ids)

    def release(self, request_id: str) -> None:
        """Send a release (no answer; a session that breaks drops it and the hold runs out on its lease)."""
        with self._lock:
            if self._ready(Future()):
                self._stream.put(pb.ReadBatch(releases=[pb.ReleaseRequest(engine_id=self.engine_id,
                                                                         request_id=request_id)]))

    def final_layers(self, request: pb.FinalLayersRequest) -> None:
        """Send a FinalLayers call (no answer; a refused one is counted by the daemon)."""
        with self._lock:
            if self._ready(Future()):
                self._stream.put(pb.ReadBatch(final_layers=[request]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._stream is not None:
                self._stream.cancel()

    # ---- the stream -------------------------------------------------------------------
    def _ready(self, waiter: Future) -> bool:
        """A usable stream (a new one when the last broke), with the lock held; else ``waiter`` fails."""
        if self._stream is not None and not self._stream.usable:
            self._stream = None  # broken: its reader fails what waited on it
        if self._closed:
            error = ReadsSocketError(grpc.StatusCode.CANCELLED, "the control session was closed")
        elif self._stream is None:
            error = self._open()
        else:
            error = None
        if error is not None:
            waiter.set_exception(error)
        return error is None

    def _open(self) -> ReadsSocketError | None:
        waiting = _Waiting()
        first = pb.ReadBatch(engine_id=self.engine_id, session=self.session, control=True)
        try:
            stream = ReadsSocketStream(self.path, first, timeout_s=self.timeout_s,
                                       max_frame_bytes=self.max_frame_bytes,
                                       on_holds=lambda answers: self._hold_answers(waiting, answers),
                                       on_renewals=lambda answers: self._renewal_answers(waiting, answers),
                                       daemon_uid=self.daemon_uid)
        except PermissionDeniedError as err:  # another user listens there: nothing was sent
            return ReadsSocketError(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except OSError as err:  # no socket to be had (too many open files, say)
            return ReadsSocketError(grpc.StatusCode.UNAVAILABLE, f"reads socket {self.path}: {err}")
        if not stream.connected:
            try:
                next(iter(stream))
            except ReadsSocketError as err:
                return err
        self._stream, self._waiting = stream, waiting
        threading.Thread(target=self._watch, args=(stream, waiting), name="kvxferd-control", daemon=True).start()
        return None

    def _watch(self, stream: ReadsSocketStream, waiting: _Waiting) -> None:
        """The reader thread of one stream: answers arrive through the callbacks; its end fails what still
        waits on it (a refusal as the daemon said it; a broken connection: the outcome unknown)."""
        try:
            for _ in stream:
                pass  # a control session gets no completions
            error = ReadsSocketError(grpc.StatusCode.UNAVAILABLE, "the daemon ended the control session")
        except grpc.RpcError as err:
            error = err
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            error = ReadsSocketError(error.code(), f"the control session ended before the answer (it may or may "
                                                   f"not have been done): {error.details()}")
        with self._lock:
            if self._stream is stream:
                self._stream = None
            left = waiting.all()
            waiting.holds.clear()
            waiting.renewals.clear()
        for answer in left:
            if not answer.done():
                answer.set_exception(error)

    def _hold_answers(self, waiting: _Waiting, answers) -> None:
        matched = []
        with self._lock:
            for answer in answers:
                queue = waiting.holds.get(answer.request_id)
                matched.append(queue.popleft() if queue else None)
                if queue is not None and not queue:
                    del waiting.holds[answer.request_id]
        for future, answer in zip(matched, answers):
            if future is not None and not future.done():
                future.set_result(answer)

    def _renewal_answers(self, waiting: _Waiting, answers) -> None:
        with self._lock:
            futures = [waiting.renewals.popleft() for _ in answers if waiting.renewals]
        for future, answer in zip(futures, answers):
            if not future.done():
                future.set_result(answer)

    def _result(self, answer: Future, what: str):
        try:
            return answer.result(self.timeout_s)
        except TimeoutError:
            raise ReadsSocketError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to {what} within "
                                                                      f"{self.timeout_s:g} s") from None
