"""Who listens on a daemon's UNIX sockets: an engine checks before it sends a session, a handle or an fd.

The daemon's uid is the engine's own unless told (``daemon_uid``, else
``$KVXFERD_DAEMON_UID``; root is not assumed: a root daemon is named with
0). Raw sockets (fd socket, reads socket) are asked with ``SO_PEERCRED``
once connected; the gRPC socket, whose peer gRPC does not show, by its
file before every call (:func:`check_daemon_socket`). Both sides use
:func:`peer_credentials` (the daemon checks its callers with it).
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a UNIX socket (``SO_PEERCRED``)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


DAEMON_UID_ENV = "KVXFERD_DAEMON_UID"  # the daemons' uid, for engines that run as another user


def daemon_uid_or_own(daemon_uid: int | None) -> int:
    """The uid an engine expects its daemon to run as: ``daemon_uid`` when given, else
    ``$KVXFERD_DAEMON_UID`` when set (a pod whose engine runs as another user), else its own."""
    if daemon_uid is None:
        from_env = os.environ.get(DAEMON_UID_ENV, "").strip()
        if not from_env:
            return os.getuid()
        if not (from_env.isascii() and from_env.isdigit()):
            raise InvalidArgumentError(DAEMON_UID_ENV, f"a uid (digits), got {from_env[:32]!r}")
        return int(from_env)
    if isinstance(daemon_uid, bool) or not isinstance(daemon_uid, int) or daemon_uid < 0:
        raise InvalidArgumentError("daemon_uid", f"a uid (an int >= 0), got {daemon_uid!r}")
    return daemon_uid


def _refuse_listener(what: str, found: int, daemon_uid: int) -> PermissionDeniedError:
    return PermissionDeniedError("daemon_uid", f"{what} belongs to uid {found}, not to the daemon's uid {daemon_uid}: "
                                               "nothing was sent to it (if the daemon runs as that user, say so "
                                               "with daemon_uid)")


def check_daemon_socket(path: str, daemon_uid: int) -> None:
    """Before a call on a daemon's gRPC UNIX socket: the socket file must belong to ``daemon_uid``, and so
    must its directory (or to root, e.g. a pod's shared directory).

    Checked before every call: gRPC reconnects by itself (a restarted
    daemon), and in a directory others may write someone else's socket
    may be in its place by then. A missing socket (or directory) is left to
    the call, which fails ``UNAVAILABLE``. Raises :class:`PermissionDeniedError`
    naming the uid found.
    """
    try:
        directory = os.stat(os.path.dirname(path) or ".")
        info = os.stat(path)  # through a symlink: what gRPC will connect to
    except FileNotFoundError:
        return
    except OSError as err:  # not even ours to look at
        raise PermissionDeniedError("daemon_uid", f"cannot check who owns {path}: {err.strerror}") from None
    if directory.st_uid not in (daemon_uid, 0):
        raise _refuse_listener(f"the directory of {path}", directory.st_uid, daemon_uid)
    if info.st_uid != daemon_uid:
        raise _refuse_listener(path, info.st_uid, daemon_uid)
    if not stat.S_ISSOCK(info.st_mode):
        raise PermissionDeniedError("daemon_uid", f"{path} is not a socket")


def check_daemon_peer(conn: socket.socket, daemon_uid: int, path: str) -> None:
    """After connecting to one of a daemon's raw UNIX sockets and before sending a byte: the process
    listening must run as ``daemon_uid`` (``SO_PEERCRED``), else :class:`PermissionDeniedError`."""
    _pid, uid, _gid = peer_credentials(conn)
    if uid != daemon_uid:
        raise _refuse_listener(f"the process listening on {path}", uid, daemon_uid)
