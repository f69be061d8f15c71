"""The engine's reads session as a reader worker holds it: its socket and its numbered completions.

The control plane accepts the engine's reads socket, checks who is on it
(``SO_PEERCRED``, the registration's session in the first batch) and hands
it over with the feed of completions the engine has not acked yet
(``service/net/sessions.py``)::

    engine ◄──── frames (wire/frames.py) ────► SessionSocket: bytes in, frames out (never blocking;
                                               a session that stops reading stops taking reads)
                                               SessionFeed: seq 1, 2, ... per registration, kept
                                               until acked; a new session gets every unacked again

The feed outlives a session (the engine reconnects to the control plane,
which hands the new one to this worker: nothing is lost) but not this
worker: after its death the control plane numbers on from the engine's ack,
and the engine sends its reads without completions again.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Iterable

from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.frames import COMPLETIONS_PER_BATCH, FrameReader, encode_frame

WRITE_HIGH_WATER_BYTES = 1 << 20  # as the control plane's: a session that does not read takes no more holds
MAX_WRITE_BYTES = 64 << 20  # unread completions and answers kept for a session; beyond, it is ended
RECEIVE_BYTES = 1 << 18


class SessionGone(Exception):
    """The engine closed its end, or the socket failed: the session is over (the feed stays)."""


class SessionSocket:
    """The engine's end of a handed-over reads session (the worker's thread only)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int, pending: bytes = b"") -> None:
        sock.setblocking(False)
        self.sock = sock
        self.frames = FrameReader(max_frame_bytes)
        self.out = bytearray()
        self.ending = False  # the end frame is queued: closed once it is written
        self.closed = False
        self._pending = pending  # bytes the control plane had read past the first batch

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[bytes]:
        """The frames that arrived (the control plane's leftover first); :class:`SessionGone` at end of
        file; ResourceExhaustedError for a frame over the limit."""
        if self._pending:
            data, self._pending = self._pending, b""
            return self.frames.feed(data)
        try:
            data = self.sock.recv(RECEIVE_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as err:
            raise SessionGone(str(err)) from None
        if not data:
            raise SessionGone("the engine closed its session")
        return self.frames.feed(data)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def writable(self) -> bool:
        """Room for more (an engine that reads what it is sent)."""
        return len(self.out) < WRITE_HIGH_WATER_BYTES and not self.ending and not self.closed

    @property
    def wants_write(self) -> bool:
        return bool(self.out) and not self.closed

    def write(self, payload: bytes) -> None:
        """Queue one frame and write what the socket takes now; :class:`SessionGone` when the engine left
        too much unread (MAX_WRITE_BYTES) or the socket failed."""
        if self.closed:
            return
        self.out += encode_frame(payload)
        if len(self.out) > MAX_WRITE_BYTES:
            raise SessionGone(f"the engine left {len(self.out)} bytes unread")
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes; close once an ended session's last frame is out."""
        while self.out and not self.closed:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                raise SessionGone(str(err)) from None
            del self.out[:sent]
        if self.ending and not self.out:
            self.close()

    def end(self, code: int, message: str) -> None:
        """The last frame (a gRPC status code and why), then close once it is written."""
        if self.ending or self.closed:
            return
        self.write(pb.CompletionBatch(end_code=code, end_message=message[:1024]).SerializeToString())
        self.ending = True
        self.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


class SessionFeed:
    """The registration's completions: numbered here, kept until the engine acks them."""

    def __init__(self, last_seq: int, unacked: Iterable[pb.Completion] = ()) -> None:
        self.queued: collections.deque[pb.Completion] = collections.deque()
        self._ids: dict[str, int] = {}
        self.next_seq = last_seq + 1
        for completion in unacked:  # the control plane's, in its order
            if not (self.queued[-1].seq if self.queued else 0) < completion.seq <= last_seq:
                raise InvalidArgumentError("unacked", "completions in seq order, none past the last seq")
            self.queued.append(completion)
            self._ids[completion.request_id] = self._ids.get(completion.request_id, 0) + 1

    def __len__(self) -> int:
        return len(self.queued)

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def put(self, completion: pb.Completion) -> pb.Completion:
        """Number and keep it; the caller writes it."""
        completion.seq = self.next_seq
        self.next_seq += 1
        self.queued.append(completion)
        self._ids[completion.request_id] = self._ids.get(completion.request_id, 0) + 1
        return completion

    def ack(self, seq: int) -> None:
        """The engine has every completion up to ``seq``; one past the last sent is a broken session."""
        if seq > self.last_seq:
            raise InvalidArgumentError("ack_seq", f"{seq} acks completions not sent yet (last seq {self.last_seq})")
        while self.queued and self.queued[0].seq <= seq:
            request_id = self.queued.popleft().request_id
            left = self._ids.pop(request_id) - 1
            if left:
                self._ids[request_id] = left

    def has(self, request_id: str) -> bool:
        return request_id in self._ids

    def batches(self) -> list[bytes]:
        """Every unacked completion, in CompletionBatch payloads (what a new session gets first)."""
        return completion_batches(list(self.queued))


def completion_batches(completions: list[pb.Completion]) -> list[bytes]:
    """``completions`` in CompletionBatch payloads of at most COMPLETIONS_PER_BATCH each, in order."""
    return [pb.CompletionBatch(completions=completions[start:start + COMPLETIONS_PER_BATCH]).SerializeToString()
            for start in range(0, len(completions), COMPLETIONS_PER_BATCH)]
