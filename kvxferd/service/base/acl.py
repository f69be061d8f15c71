"""POSIX access ACLs on the daemon's sockets and runtime directory: named uids, and no one else.

gRPC's Python server does not say who connected, so the engine socket
cannot check ``SO_PEERCRED`` as the fd and reads sockets do: the kernel
must refuse everyone else at ``connect``. A file mode names one user and
one group, and the group (a pod's ``fsGroup``) was every container of the
pod. An access ACL names each allowed uid instead::

    user::rw-            the daemon's user
    user:10002:rw-       each of allowed_uids (the engine)
    group::---           (rw- with engine_socket_group)
    mask::rw-
    other::---

It is the kernel's own format of the ``system.posix_acl_access`` extended
attribute (``linux/posix_acl_xattr.h``: a version, then tag, permissions
and id per entry, sorted by tag and id), written with ``os.setxattr``:
``libacl``'s Python binding needs a C build, and this is 4 + 8 bytes per
entry. The kernel checks it at ``connect`` only: calls on a connection
cost nothing more. Filesystems without ACLs (``EOPNOTSUPP``) keep the mode
alone; :func:`grant` says so.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
READ, WRITE, EXECUTE = 4, 2, 1
_HEADER, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP)


def encode(owner: int, group: int, other: int, users: dict[int, int]) -> bytes:
    """The xattr value of an access ACL: ``owner``/``group``/``other`` permissions (0-7) and one entry per
    named uid (``users``: uid -> permissions), with the mask they need."""
    entries = [(USER_OBJ, owner, UNDEFINED_ID), (GROUP_OBJ, group, UNDEFINED_ID), (OTHER, other, UNDEFINED_ID)]
    entries += [(USER, perms, uid) for uid, perms in users.items()]
    if users:
        mask = group
        for perms in users.values():
            mask |= perms
        entries.append((MASK, mask, UNDEFINED_ID))
    return _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*entry) for entry in sorted(entries))


def decode(value: bytes) -> list[tuple[int, int, int]]:
    """``(tag, permissions, id)`` of each entry of an access ACL's xattr value."""
    if len(value) < _HEADER.size or (len(value) - _HEADER.size) % _ENTRY.size or _HEADER.unpack_from(value)[0] != VERSION:
        raise ValueError("not a POSIX ACL (version 2) xattr value")
    return [_ENTRY.unpack_from(value, offset) for offset in range(_HEADER.size, len(value), _ENTRY.size)]


def grant(path: str, users: Iterable[int], perms: int, *, owner: int, group: int) -> bool:
    """Give each uid of ``users`` (but this process's own and root, who need none) ``perms`` on ``path``,
    beside ``owner`` and ``group`` (others: nothing); with no such uid, remove any ACL left from an earlier
    start. False where the filesystem has no ACLs (the mode alone then decides)."""
    named = {uid: perms for uid in sorted(set(users) - {os.getuid(), 0})}
    try:
        if named:
            os.setxattr(path, XATTR, encode(owner, group, 0, named), follow_symlinks=False)
        else:
            os.removexattr(path, XATTR, follow_symlinks=False)
    except OSError as err:
        if err.errno == errno.ENODATA:  # no ACL to remove
            return True
        if err.errno in UNSUPPORTED:
            return not named
        raise
    return True


def named_users(path: str) -> dict[int, int]:
    """The uids an access ACL on ``path`` names, with their permissions (empty without one)."""
    try:
        value = os.getxattr(path, XATTR, follow_symlinks=False)
    except OSError:
        return {}
    return {ident: perms for tag, perms, ident in decode(value) if tag == USER}
