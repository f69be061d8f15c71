"""Engine side of the fd socket: hand file descriptors (shm objects, CUDA VMM fds) to the daemon.

gRPC cannot carry fds, so an engine sends them first over ``<engine_socket>.fds``
(:func:`kvxferd.wire.names.fd_socket_path`) with ``SCM_RIGHTS``, tagged with a
token it chose; its ``Register`` then names the token and each region's
``*_fd_index`` (the daemon's side: :mod:`kvxferd.service.engines.fdpass`).
"""

from __future__ import annotations

import os
import socket

from kvxferd.wire.names import FD_ANSWER_MAX_BYTES
from kvxferd.wire.owner import check_daemon_peer, daemon_uid_or_own


def send_fds(path: str, token: str, fds: list[int], timeout_s: float = 5.0, *, daemon_uid: int | None = None) -> None:
    """Engine side: hand ``fds`` to the daemon under ``token``; only to a daemon running as ``daemon_uid``
    (default: this process's uid), else :class:`PermissionDeniedError` and nothing is sent."""
    expected_uid = daemon_uid_or_own(daemon_uid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        check_daemon_peer(conn, expected_uid, path)
        socket.send_fds(conn, [token.encode()], fds)
        answer = conn.recv(FD_ANSWER_MAX_BYTES)
        if answer != b"ok":
            reason = answer.decode(errors="replace") if answer else "no answer (see its log)"
            raise ConnectionError(f"daemon at {path} did not accept the fds: {reason}")


MAX_FDS_PER_MESSAGE = 253  # SCM_MAX_FD: the most one sendmsg carries

_own_pidfd: tuple[int, int] | None = None  # (pid, its pidfd): made once per process, never after a fork's


def own_process_fd() -> int:
    """A pidfd of this process (``pidfd_open(getpid())``), to pass with the cache's fds and name in
    ``RegisterRequest.process_fd_index``: the daemon then lets go of the registration, and unmaps the
    memory, the moment this process exits (:mod:`kvxferd.service.engines.lifeline`). Kept open: the
    same one is passed again after a daemon restart."""
    global _own_pidfd
    if _own_pidfd is None or _own_pidfd[0] != os.getpid():
        _own_pidfd = (os.getpid(), os.pidfd_open(os.getpid()))
    return _own_pidfd[1]
