"""Take file descriptors (shared-memory and CUDA VMM handles) an engine passes to its daemon.

The engine's side is :func:`kvxferd.client.fdsend.send_fds`; the socket's path
:func:`kvxferd.wire.names.fd_socket_path`.

gRPC cannot carry fds, so an engine sends them first over a plain UNIX
socket next to the engine socket (``<engine_socket>.fds``) with
``SCM_RIGHTS``, tagged with a token it chose; its ``Register`` then names
the token and each region's ``*_fd_index``. Unclaimed fds are closed after
``ttl_s``.

The socket is a listener like any other: each connection must come from
an allowed uid (``SO_PEERCRED``), send its one message within
``recv_timeout_s`` (a silent client delays others by at most that), carry
at most ``max_fds`` fds and a printable token; at most ``max_tokens``
deliveries and ``max_fds_waiting`` fds (all clients together) wait at
once. A delivery over a bound is answered ``refused: <limit>`` and its fds
are closed. A client that vanishes mid-way costs nothing.

The other way (issue #56): a same-host reader daemon sends ``share:<token>``
and no fds; the answer is ``ok`` with the fd of the VMM allocation the
holder offered under that token (:meth:`FdInbox.offer`: 128 random bits,
given only to authenticated same-host readers), else ``refused: ...``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import grpc

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base import audit
from kvxferd.service.base.localsock import credentials_allowed
from kvxferd.wire.names import FD_ANSWER_MAX_BYTES
from kvxferd.wire.owner import peer_credentials
from kvxferd.xfer.osutil.osthreads import name_this_thread
from kvxferd.xfer.samehost.vmmshare import SHARE_PREFIX

log = logging.getLogger("kvxferd.fdpass")
MAX_FDS = 4096
MAX_TOKEN_BYTES = 256


class FdInbox:
    """A thread accepting ``(token, fds)`` messages from allowed local users."""

    def __init__(self, path: str, *, ttl_s: float = 60.0, allowed_uids: frozenset[int] = frozenset(),
                 group: int | None = None, max_fds: int = MAX_FDS, max_tokens: int = 256, recv_timeout_s: float = 2.0,
                 max_fds_waiting: int = 4096, on_refused: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self.allowed_uids, self.group = allowed_uids, group
        self.max_fds, self.max_tokens, self.recv_timeout_s = max_fds, max_tokens, recv_timeout_s
        self.max_fds_waiting = max_fds_waiting
        self.on_refused = on_refused or (lambda reason: None)
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[float, list[int]]] = {}
        self._shares: dict[str, int] = {}  # token -> an fd the registry owns (offer / withdraw)
        self.num_fds_waiting = 0  # in self._fds, all tokens together
        if os.path.exists(path):
            os.unlink(path)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)  # the caller sets the umask: never world-accessible
        self._socket.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvxferd-fd-inbox", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        name_this_thread()
        while not self._closed:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return
            with conn:
                try:
                    self._receive(conn)
                except OSError:  # timed out, reset, or gone before our answer: its fds were closed
                    self.on_refused("io")
                except Exception:  # never let one client end the inbox
                    log.exception("fd socket: unexpected error")
                    self.on_refused("error")

    def _receive(self, conn: socket.socket) -> None:
        """Take one delivery, or count and answer its refusal."""
        pid, uid, gid = peer_credentials(conn)
        if not credentials_allowed(uid, gid, self.allowed_uids, self.group):
            audit.socket_refused("fd", uid, pid, grpc.StatusCode.PERMISSION_DENIED,
                                 "uid not on allowed_uids (SO_PEERCRED)")
            self.on_refused("uid")
            return
        conn.settimeout(self.recv_timeout_s)
        # One byte more than a token may have: a stream socket never says MSG_TRUNC, so a longer token
        # shows as that byte (else its first 256 bytes would pass for the token).
        token_bytes, fds, flags, _addr = socket.recv_fds(conn, MAX_TOKEN_BYTES + 1, self.max_fds)
        if not token_bytes and not fds:  # the client went away without a message
            self.on_refused("io")
            return
        try:
            token = token_bytes.decode()
        except UnicodeDecodeError:
            token = ""
        if not fds and token.startswith(SHARE_PREFIX) and not flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            self._serve_share(conn, token[len(SHARE_PREFIX):])
            return
        if (flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not fds or not token or not token.isprintable()
                or len(token_bytes) > MAX_TOKEN_BYTES):
            _close(fds)
            self._refuse(conn, "malformed", "not one printable token of 1..256 bytes with 1..max_fds_per_token fds")
            return
        self._expire()
        with self._lock:
            if token in self._fds or len(self._fds) >= self.max_tokens:
                refusal = ("tokens", f"max_fd_tokens ({self.max_tokens} deliveries wait) or a token in use")
            elif self.num_fds_waiting + len(fds) > self.max_fds_waiting:
                refusal = ("fds", f"max_fds_waiting ({self.num_fds_waiting} of {self.max_fds_waiting} fds wait "
                                  f"for their Register; this delivery has {len(fds)})")
            else:
                refusal = None
                self._fds[token] = (time.monotonic(), list(fds))
                self.num_fds_waiting += len(fds)
        if refusal is not None:
            _close(fds)
            self._refuse(conn, *refusal)
            return
        conn.sendall(b"ok")

    def _serve_share(self, conn: socket.socket, token: str) -> None:
        with self._lock:
            fd = self._shares.get(token)
            if fd is not None:
                fd = os.dup(fd)  # ours while sent: a withdraw meanwhile cannot close it under send_fds
        if fd is None:
            self._refuse(conn, "share", "no allocation is shared under that token")
            return
        try:
            socket.send_fds(conn, [b"ok"], [fd])
        finally:
            os.close(fd)

    def offer(self, token: str, fd: int) -> None:
        """Serve ``fd`` (the caller keeps it) to a same-host reader that presents ``token``."""
        with self._lock:
            self._shares[token] = fd

    def withdraw(self, token: str) -> None:
        """Stop serving what was offered under ``token`` (before its fd closes)."""
        with self._lock:
            self._shares.pop(token, None)

    def _refuse(self, conn: socket.socket, reason: str, limit: str) -> None:
        """Count the refusal, then tell the client why (it may be gone already).

        Counted first: a client that has read the answer finds the counter already moved."""
        self.on_refused(reason)
        try:
            conn.sendall(f"refused: {limit}".encode()[:FD_ANSWER_MAX_BYTES])
        except OSError:
            pass

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for token in [t for t, (at, _) in self._fds.items() if now - at > self.ttl_s]:
                fds = self._fds.pop(token)[1]
                self.num_fds_waiting -= len(fds)
                _close(fds)

    def take(self, token: str) -> list[int]:
        """Claim the fds sent under ``token`` (the caller owns and closes them); a delivery older than
        ``ttl_s`` is gone."""
        self._expire()
        with self._lock:
            entry = self._fds.pop(token, None)
            if entry is not None:
                self.num_fds_waiting -= len(entry[1])
        if entry is None:
            raise InvalidArgumentError("fd_token", f"no fds were sent under token {token[:80]!r} "
                                                   "(send them to the fd socket first)")
        return entry[1]

    def close(self) -> None:
        self._closed = True
        self._socket.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
        with self._lock:
            for _, fds in self._fds.values():
                _close(fds)
            self._fds.clear()
            self.num_fds_waiting = 0


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)
