"""The engine-side UNIX sockets: who may connect, enforced by the kernel.

Two layers, so no window exists in which another user could connect::

    runtime dir  0700 (0750 with engine_socket_group), owned by the daemon's user,
    │            created by the daemon; refused if it is a symlink or someone else's
    │            (under /tmp: a fallback of its own, claim_runtime_dir)
    ├── <id>.sock        engine gRPC   0600 (0660)   created under umask 0177 (0117):
    ├── <id>.sock.fds    fd passing    0600 (0660)   never world-accessible, not even briefly
    └── <id>.sock.reads  reads         0600 (0660)

    allowed_uids: an ACL entry on each (rw-; --x on the runtime directory), set
    right after bind, so each allowed uid and no one else of the group connects

gRPC does not hand a Python server the peer's credentials, so the engine
socket relies on these modes and ACL entries; the fd and reads sockets,
which are ours, also check ``SO_PEERCRED`` against the allowed uids on
every connection.

The other way round (an engine checking who listens) is
:mod:`kvxferd.wire.owner`.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import stat
import tempfile
import time

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError
from kvxferd.service.base import acl
from kvxferd.wire.names import own_fallback_dirs

log = logging.getLogger("kvxferd.daemon")


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


def prepare_private_dir(path: str, gid: int | None, uids: frozenset[int] = frozenset()) -> None:
    """Create the daemon's runtime directory, or check that an existing one is ours and private; each of
    ``uids`` (allowed_uids) may pass through it to the sockets (an ACL entry ``--x``: :mod:`.acl`).

    Used for the default directory only; an explicitly configured socket
    path lives in a directory the operator chose (e.g. a pod's shared
    ``emptyDir``) and is protected by the socket's own mode and ACL.
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
    _grant(path, uids, acl.EXECUTE, owner=7, group=5 if gid is not None else 0)


def _grant(path: str, uids: frozenset[int], perms: int, *, owner: int, group: int) -> None:
    if not acl.grant(path, uids, perms, owner=owner, group=group):
        log.warning("allowed_uids: this filesystem has no POSIX ACLs, so only the file mode (and "
                    "engine_socket_group) admits other users here", extra={"path": path})


def claim_runtime_dir(path: str, gid: int | None, *, default: bool, uids: frozenset[int] = frozenset()) -> str:
    """The default runtime directory ``path``, made ready (:func:`prepare_private_dir`); the directory to use.

    Under /tmp anyone may create ``kvxferd-<uid>`` first and keep this
    user's daemon from ever starting. Then the daemon uses this user's own
    fallback ``/tmp/kvxferd-<uid>.<random>`` (made now when there is none),
    which engines and ``kvxferd health`` find by themselves
    (:func:`kvxferd.wire.names.tmp_runtime_dir`), and says so in the log.
    Any other directory someone else owns, and one the operator chose
    (``default`` False), is still refused.
    """
    try:
        prepare_private_dir(path, gid, uids)
        return path
    except PermissionDeniedError:
        parent = os.path.dirname(path)
        if not default or path != os.path.join(parent, f"kvxferd-{os.getuid()}"):
            raise
    with _locked(parent):  # daemons of this user starting together make one fallback, not one each
        fallbacks = own_fallback_dirs(parent)
        fallback = fallbacks[0] if fallbacks else tempfile.mkdtemp(prefix=f"kvxferd-{os.getuid()}.", dir=parent)
    prepare_private_dir(fallback, gid, uids)
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        owner = -1
    log.warning("runtime directory taken: another user made it first; this daemon uses its own fallback, which "
                "engines and `kvxferd health` of this user find by themselves", extra={
                    "squatted": path, "squatted_by_uid": owner, "runtime_dir": fallback})
    return fallback


@contextlib.contextmanager
def _locked(directory: str, timeout_s: float = 2.0):
    """``flock`` on ``directory`` (/tmp) while the fallback is chosen. Anyone may hold it: after ``timeout_s``
    the daemon goes on without it (two daemons starting in that very moment may then pick two fallbacks)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("could not lock %s to choose the runtime directory; going on without", directory)
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def socket_umask(gid: int | None):
    """Sockets bound inside are created 0600 (0660 with a group): set the umask around ``bind``."""
    old = os.umask(0o117 if gid is not None else 0o177)
    try:
        yield
    finally:
        os.umask(old)


def restrict_socket(path: str, gid: int | None, uids: frozenset[int] = frozenset()) -> None:
    """Give a freshly bound socket its group and exact mode (the umask made it no wider), and each of ``uids``
    (allowed_uids) an ACL entry ``rw-``: the engine socket then admits the allowed uids and no one else of
    the group, as the fd and reads sockets do by ``SO_PEERCRED`` (:mod:`.acl`)."""
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660 if gid is not None else 0o600)
    _grant(path, uids, acl.READ | acl.WRITE, owner=6, group=6 if gid is not None else 0)


def credentials_allowed(uid: int, gid: int, allowed_uids: frozenset[int], group: int | None) -> bool:
    """Root, the daemon's own user, an allowed uid, or (with ``engine_socket_group``) that group."""
    return uid in (0, os.getuid()) or uid in allowed_uids or (group is not None and gid == group)
