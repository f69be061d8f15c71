"""The engine-side UNIX sockets: who may connect, enforced by the kernel.

Two layers, so no window exists in which another user could connect::

    runtime dir  0700 (0750 with engine_socket_group), owned by the daemon's user,
    │            created by the daemon; refused if it is a symlink or someone else's
    ├── <id>.sock      engine gRPC   0600 (0660)   created under umask 0177 (0117):
    └── <id>.sock.fds  fd passing    0600 (0660)   never world-accessible, not even briefly

gRPC does not hand a Python server the peer's credentials, so the engine
socket relies on these modes; the fd socket, which is ours, also checks
``SO_PEERCRED`` against the allowed uids on every connection.

The other way round (an engine checking who listens) is
:mod:`kvxferd.wire.owner`.
"""

from __future__ import annotations

import contextlib
import grp
import os
import stat

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError


def group_id(group: str | None) -> int | None:
    """The gid of ``engine_socket_group`` (a name or a number); None when unset."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidArgumentError("engine_socket_group", f"no group named {group!r}") from None


def prepare_private_dir(path: str, gid: int | None) -> None:
    """Create the daemon's runtime directory, or check that an existing one is ours and private.

    Used for the default directory only; an explicitly configured socket
    path lives in a directory the operator chose (e.g. a pod's shared
    ``emptyDir``) and is protected by the socket's own mode.
    """
    mode = 0o750 if gid is not None else 0o700
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionDeniedError("runtime_dir", f"{path} is not a directory (a symlink?); refusing to use it")
    if info.st_uid != os.getuid():
        raise PermissionDeniedError("runtime_dir", f"{path} belongs to uid {info.st_uid}, not to this daemon's "
                                                   f"uid {os.getuid()}; remove it or set runtime_dir")
    if gid is not None and info.st_gid != gid:
        os.chown(path, -1, gid)
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)


@contextlib.contextmanager
def socket_umask(gid: int | None):
    """Sockets bound inside are created 0600 (0660 with a group): set the umask around ``bind``."""
    old = os.umask(0o117 if gid is not None else 0o177)
    try:
        yield
    finally:
        os.umask(old)


def restrict_socket(path: str, gid: int | None) -> None:
    """Give a freshly bound socket its group and exact mode (the umask made it no wider)."""
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660 if gid is not None else 0o600)


def credentials_allowed(uid: int, gid: int, allowed_uids: frozenset[int], group: int | None) -> bool:
    """Root, the daemon's own user, an allowed uid, or (with ``engine_socket_group``) that group."""
    return uid in (0, os.getuid()) or uid in allowed_uids or (group is not None and gid == group)
