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
import struct
import time
from collections.abc import Sequence

from kvxferd.cuda.vmm import ImportedAllocation, import_allocation
from kvxferd.errors import KvxferError, TransferError
from kvxferd.plan.groups import EngineCache, VmmShare
from kvxferd.xfer.samehost.opened import proc_of

FETCH_TIMEOUT_S = 2.0  # for every share of one handshake together
SHARE_PREFIX = "share:"  # on the fd socket, with no fds: a same-host reader asks for an allocation's fd
ANSWER_MAX_BYTES = 256  # the fd socket's answer ("ok" or "refused: ..."): wire/names.FD_ANSWER_MAX_BYTES


def fetch_fd(share: VmmShare, timeout_s: float = FETCH_TIMEOUT_S) -> int:
    """The allocation's fd from the holder (the caller closes it); :class:`TransferError` saying why not.

    The holder's process is held open (``/proc/<pid>``, this user's only) and its socket reached through
    that handle's root, never by the bare path; the process that answers must be the holder itself
    (``SO_PEERCRED``), and the whole exchange ends within ``timeout_s``."""
    if not share.socket_path.endswith(".fds"):
        raise TransferError("same_host", "the holder's share socket is not an fd socket")
    proc = proc_of(share.holder_pid)
    deadline = time.monotonic() + timeout_s
    directory = -1
    try:
        # Through the socket's directory, held open: the path connect() is given stays short (a UNIX socket's
        # path has 108 bytes), however deep the holder's socket lies.
        parent, name = os.path.split(share.socket_path)
        directory = os.open(f"/proc/self/fd/{proc}/root{parent}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(f"/proc/self/fd/{directory}/{name}")
            pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
            if pid != share.holder_pid:
                raise TransferError("same_host", f"process {pid}, not the holder ({share.holder_pid}), answers there")
            conn.sendall((SHARE_PREFIX + share.token).encode())
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            answer, fds, _flags, _addr = socket.recv_fds(conn, ANSWER_MAX_BYTES, 1)
    except OSError as err:
        raise TransferError("same_host", f"cannot reach the holder's fd socket: {err.strerror or err}") from None
    finally:
        os.close(proc)
        if directory >= 0:
            os.close(directory)
    if answer != b"ok" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise TransferError("same_host", f"the holder did not share its GPU memory: "
                                         f"{answer.decode(errors='replace')[:200] or 'no answer'}")
    return fds[0]


def fetch_shares(remotes: Sequence[EngineCache], budget_s: float = FETCH_TIMEOUT_S) -> dict[str, int | str]:
    """Each VMM share's fd (one fetch per allocation), or why not, within ``budget_s`` for them all: done
    before a connection is made, off the data-plane thread (a holder that does not answer costs a
    handshake that long, never the reads of other engines)."""
    fetched: dict[str, int | str] = {}
    deadline = time.monotonic() + budget_s
    try:
        for share in {r.share for c in remotes if c.mem_type == "VRAM" for m in c.memory for r in m}:
            if isinstance(share, VmmShare) and share.token not in fetched:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TransferError("same_host", f"no answer within {budget_s:g} s")
                    fetched[share.token] = fetch_fd(share, left)
                except TransferError as err:
                    fetched[share.token] = err.message
    except BaseException:
        for fd in fetched.values():
            if isinstance(fd, int):
                os.close(fd)
        raise
    return fetched


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
