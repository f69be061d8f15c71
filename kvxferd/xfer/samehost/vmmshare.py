"""A same-host holder's GPU VMM memory, fetched by the reader as an fd and mapped here (issue #56).

A VMM allocation's POSIX fd cannot be opened again by path (``/proc/<pid>/fd``
gives a new, unrelated descriptor of the driver's device), so the holder
serves it: the reader connects to the holder's fd socket through the
holder's own root (``/proc/<holder_pid>/root<socket>``: the same user and PID
namespace, as for host memory passed as fds), sends ``share:<token>`` and
receives the fd with ``SCM_RIGHTS``; it imports and maps the whole
allocation on its own GPU::

    reader ── share:<token> ──► holder's fd socket ── ok + fd ──► cuMemImportFromShareableHandle, map
    remote span at a ──► a - A_r + B + offset_r (as for an IPC handle: devicemaps.py)
"""

from __future__ import annotations

import os
import socket

from kvxferd.cuda.vmm import ImportedAllocation, import_allocation
from kvxferd.errors import KvxferError, TransferError
from kvxferd.plan.groups import VmmShare

FETCH_TIMEOUT_S = 5.0
SHARE_PREFIX = "share:"  # on the fd socket, with no fds: a same-host reader asks for an allocation's fd
ANSWER_MAX_BYTES = 256  # the fd socket's answer ("ok" or "refused: ..."): wire/names.FD_ANSWER_MAX_BYTES


def share_socket_of(share: VmmShare) -> str:
    """Where the holder's fd socket is, seen from here: through its root when its process is visible."""
    root = f"/proc/{share.holder_pid}/root"
    return root + share.socket_path if os.path.isdir(root) else share.socket_path


def fetch_fd(share: VmmShare, timeout_s: float = FETCH_TIMEOUT_S) -> int:
    """The allocation's fd from the holder (the caller closes it); :class:`TransferError` saying why not."""
    path = share_socket_of(share)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(path)
            conn.sendall((SHARE_PREFIX + share.token).encode())
            answer, fds, _flags, _addr = socket.recv_fds(conn, ANSWER_MAX_BYTES, 1)
    except OSError as err:
        raise TransferError("same_host", f"cannot reach the holder's fd socket {path}: {err.strerror or err}") from None
    if answer != b"ok" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise TransferError("same_host", f"the holder did not share its GPU memory: "
                                         f"{answer.decode(errors='replace') or 'no answer'}")
    return fds[0]


def open_vmm_share(share: VmmShare, device_id: int, lib=None, fetch=fetch_fd) -> ImportedAllocation:
    """Fetch and map the holder's allocation on ``device_id``."""
    fd = fetch(share)
    try:
        return import_allocation(fd, share.allocation_bytes, device_id, "same_host", lib)
    except KvxferError as err:
        raise TransferError("same_host", f"cannot map the holder's GPU memory (on {share.device_uuid}) on GPU "
                                         f"{device_id}: {err.message}") from None
    finally:
        os.close(fd)  # the imported handle keeps the allocation
