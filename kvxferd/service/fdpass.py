"""Pass file descriptors (CUDA VMM shareable handles) from an engine to its daemon.

gRPC cannot carry fds, so an engine sends them first over a plain UNIX
socket next to the engine socket (``<engine_socket>.fds``) with
``SCM_RIGHTS``, tagged with a token it chose; its ``Register`` then names
the token and each region's ``cuda_vmm_fd_index``. Unclaimed fds are
closed after ``ttl_s``.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from kvxferd.errors import InvalidArgumentError

MAX_FDS = 4096
MAX_TOKEN_BYTES = 256


def fd_socket_path(engine_socket: str) -> str:
    return engine_socket + ".fds"


class FdInbox:
    """A thread accepting ``(token, fds)`` messages."""

    def __init__(self, path: str, *, ttl_s: float = 60.0) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[float, list[int]]] = {}
        if os.path.exists(path):
            os.unlink(path)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)
        os.chmod(path, 0o600)
        self._socket.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvxferd-fd-inbox", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            with conn:
                try:
                    token, fds, _flags, _addr = socket.recv_fds(conn, MAX_TOKEN_BYTES, MAX_FDS)
                except OSError:
                    continue
                self._expire()
                with self._lock:
                    self._fds[token.decode(errors="replace")] = (time.monotonic(), list(fds))
                conn.sendall(b"ok")

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for token in [t for t, (at, _) in self._fds.items() if now - at > self.ttl_s]:
                for fd in self._fds.pop(token)[1]:
                    os.close(fd)

    def take(self, token: str) -> list[int]:
        """Claim the fds sent under ``token`` (the caller owns and closes them)."""
        with self._lock:
            entry = self._fds.pop(token, None)
        if entry is None:
            raise InvalidArgumentError("fd_token", f"no fds were sent under token {token!r} (send them to {self.path} first)")
        return entry[1]

    def close(self) -> None:
        self._closed = True
        self._socket.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        with self._lock:
            for _, fds in self._fds.values():
                for fd in fds:
                    os.close(fd)
            self._fds.clear()


def send_fds(path: str, token: str, fds: list[int], timeout_s: float = 5.0) -> None:
    """Engine side: hand ``fds`` to the daemon under ``token``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        socket.send_fds(conn, [token.encode()], fds)
        if conn.recv(2) != b"ok":
            raise ConnectionError(f"daemon at {path} did not accept the fds")
