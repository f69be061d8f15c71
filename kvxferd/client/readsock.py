"""The engine's side of the reads socket: a ``Reads`` session without gRPC (``wire/frames.py``).

:class:`EngineClient` uses it when its daemon is local (a ``unix:`` target)
and offers one; it behaves like the gRPC stream it replaces: ``put`` sends a
batch from the caller's thread (no hand-off to a sender thread), iterating
yields the daemon's ``CompletionBatch`` messages on the client's reader
thread, and the session ends with a :class:`ReadsSocketError` that carries a
gRPC status code, as a gRPC stream would.
"""

from __future__ import annotations

import socket
import threading

import grpc
from google.protobuf.message import DecodeError

from kvxferd.errors import KvxferError, PermissionDeniedError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.owner import check_daemon_peer, daemon_uid_or_own
from kvxferd.wire.frames import FrameReader, encode_frame

_STATUS = {code.value[0]: code for code in grpc.StatusCode}
RECV_BYTES = 1 << 16


class ReadsSocketError(grpc.RpcError):
    """How a reads-socket session ended: ``code()`` and ``details()`` as on a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str, *, broken: bool = False) -> None:
        """``broken``: the connection ended without the daemon's last word (an end frame): its reader worker,
        which served the session, died or was replaced; a new session on the same registration goes on."""
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self.broken = code, details, broken

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ReadsSocketStream:
    """One session: connected and its first batch sent in the constructor (a failure shows when iterated).

    A send that cannot finish within ``timeout_s`` (a daemon that stopped
    reading) ends the session: half a frame on the wire would garble it.
    """

    def __init__(self, path: str, first: pb.ReadBatch, *, timeout_s: float, max_frame_bytes: int,
                 on_holds=lambda answers: None, on_renewals=lambda answers: None, daemon_uid: int | None = None) -> None:
        """``on_holds``, ``on_renewals``: called on the reader thread with each frame's answers to
        ``ReadBatch.holds`` and ``ReadBatch.renewals``.
        ``daemon_uid``: who must listen (default: this process's uid); anyone else gets nothing, not
        even the first batch and its session: :class:`PermissionDeniedError`."""
        expected_uid = daemon_uid_or_own(daemon_uid)
        self.path, self.max_frame_bytes = path, max_frame_bytes
        self.on_holds, self.on_renewals = on_holds, on_renewals
        self._send_lock = threading.Lock()
        self._cancelled = False
        self._error: ReadsSocketError | None = None
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.settimeout(timeout_s)  # bounds sends; the reader loops over its own timeouts
            self._socket.connect(path)
            check_daemon_peer(self._socket, expected_uid, path)
            self._socket.sendall(encode_frame(first.SerializeToString()))
        except OSError as err:
            self._error = ReadsSocketError(grpc.StatusCode.UNAVAILABLE, f"reads socket {path}: {err}")
            self._socket.close()
        except PermissionDeniedError:
            self._socket.close()
            raise

    @property
    def connected(self) -> bool:
        """The connection was made and the first batch sent (else iterating raises why)."""
        return self._error is None

    @property
    def error(self) -> ReadsSocketError | None:
        """Why the session could not start or ended (None while it runs)."""
        return self._error

    @property
    def usable(self) -> bool:
        """Nothing has broken or cancelled it yet (as far as this side knows)."""
        return self._error is None and not self._cancelled

    def put(self, batch: pb.ReadBatch | None) -> None:
        """Send ``batch`` (None: nothing; the session ends with :meth:`cancel`)."""
        if batch is None or self._error is not None or self._cancelled:
            return
        frame = encode_frame(batch.SerializeToString())
        with self._send_lock:
            try:
                self._socket.sendall(frame)
            except OSError as err:  # the reader sees the session end
                self._error = ReadsSocketError(grpc.StatusCode.UNAVAILABLE, f"reads socket {self.path}: send: {err}",
                                               broken=True)
                self._shutdown()

    def cancel(self) -> None:
        """End the session from this side; the iteration ends with CANCELLED."""
        self._cancelled = True
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or already closed

    def __iter__(self):
        try:
            yield from self._receive()
        finally:
            self._socket.close()

    def _receive(self):
        if self._error is not None:
            raise self._error
        frames = FrameReader(self.max_frame_bytes)
        while True:
            try:
                data = self._socket.recv(RECV_BYTES)
            except TimeoutError:
                continue  # nothing to read yet: the timeout bounds sends only
            except OSError as err:
                data, error = b"", err
            else:
                error = None
            if not data:
                if self._cancelled:
                    raise ReadsSocketError(grpc.StatusCode.CANCELLED, "cancelled by the engine")
                raise self._error or ReadsSocketError(
                    grpc.StatusCode.UNAVAILABLE, f"the daemon closed the reads socket{f': {error}' if error else ''}",
                    broken=True)
            try:
                batches = [pb.CompletionBatch.FromString(payload) for payload in frames.feed(data)]
            except (KvxferError, DecodeError) as err:  # not a daemon we can talk to: end the session
                self._shutdown()
                raise ReadsSocketError(grpc.StatusCode.INTERNAL, f"reads socket {self.path}: bad frame: {err}") from None
            for batch in batches:
                if batch.end_code:
                    raise ReadsSocketError(status_of(batch.end_code), batch.end_message)
                if batch.holds:
                    self.on_holds(batch.holds)
                if batch.renewals:
                    self.on_renewals(batch.renewals)
                if batch.completions:
                    yield batch


def hold_error(answer: pb.HoldAnswer) -> ReadsSocketError | None:
    """The error of a refused hold, as its Hold call would have raised it (None when held)."""
    if not answer.code:
        return None
    return ReadsSocketError(status_of(answer.code), answer.error)


def status_of(code: int) -> grpc.StatusCode:
    """The gRPC status code a frame names by number (UNKNOWN for one gRPC does not have)."""
    return _STATUS.get(code, grpc.StatusCode.UNKNOWN)
