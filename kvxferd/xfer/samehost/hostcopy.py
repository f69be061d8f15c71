"""Copy many byte spans between two places of this process's memory, in the kernel, without a Python loop.

The same-host read path (issue #37) maps the holder engine's host memory
into the reading daemon and copies the planned spans itself. numpy has no
gather-scatter between arbitrary addresses (``dst[i] = src[j]`` goes through
a temporary: two copies of every byte), and a ``memmove`` per span is a
Python loop per block. ``process_vm_readv(2)`` on this process's own pid
takes both scattered lists at once and copies pairwise in the kernel, up to
``IOV_MAX`` spans per call; UCX's CMA transport uses the same call between
processes. A process may always read itself, so no ptrace permission is
involved; a seccomp filter may still refuse the call (:func:`available`)::

    dst_addresses  d0 d1 d2 ...     local iovecs  (d0, n0) (d1, n1) ...
    src_addresses  s0 s1 s2 ...  ─► remote iovecs (s0, n0) (s1, n1) ...  ─► one syscall per IOV_MAX pairs
    lengths        n0 n1 n2 ...

Both lists have the same lengths, so the kernel's sequential fill of the
local iovecs from the remote ones is a pairwise copy. Python loops only
per ``IOV_MAX`` (1 024) spans. A large copy drops the GIL during each call; a small one keeps it
(:data:`KEEP_GIL_MAX_BYTES`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import numpy as np

from kvxferd.errors import TransferError

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024

# A copy up to this size keeps the GIL: handing it away for tens of µs costs more (another thread takes it,
# and the copier waits for it back); a larger one (the data-plane thread's) lets the event loop run meanwhile.
KEEP_GIL_MAX_BYTES = 256 << 10


def _process_vm_readv(dll_type):
    """libc's process_vm_readv through ``dll_type``: CDLL drops the GIL for the call, PyDLL keeps it. Looked up
    among the symbols this process has loaded (libc among them): ``ctypes.util.find_library`` would run
    ldconfig, about 3.5 ms, at every import."""
    if not sys.platform.startswith("linux"):
        return None
    function = dll_type(None, use_errno=True).process_vm_readv
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return function


_readv_releasing, _readv_keeping = _process_vm_readv(ctypes.CDLL), _process_vm_readv(ctypes.PyDLL)


def iovecs(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``struct iovec`` rows ``(base, length)`` as a C-contiguous ``[n, 2]`` uint64 array."""
    rows = np.empty((len(addresses), 2), np.uint64)
    rows[:, 0] = addresses
    rows[:, 1] = lengths
    return rows


def copy_spans(dst_addresses: np.ndarray, src_addresses: np.ndarray, lengths: np.ndarray) -> int:
    """Copy ``lengths[i]`` bytes from ``src_addresses[i]`` to ``dst_addresses[i]`` for every ``i``; returns the
    bytes copied. Every address must lie in memory this process has mapped (source readable, destination
    writable), and destinations must not overlap; the caller's plan guarantees both. Raises
    :class:`TransferError` when the kernel refuses (an unmapped page, seccomp), after copying a prefix."""
    lengths = np.asarray(lengths, np.uint64)
    if not (len(dst_addresses) == len(src_addresses) == len(lengths)):
        raise TransferError("spans", "destination, source and length lists differ in length")
    if _readv_releasing is None:
        raise TransferError("spans", "same-host copies need Linux (process_vm_readv)")
    local, remote = iovecs(dst_addresses, lengths), iovecs(src_addresses, lengths)
    pid, copied = os.getpid(), 0
    readv = _readv_keeping if int(lengths.sum()) <= KEEP_GIL_MAX_BYTES else _readv_releasing
    for first in range(0, len(lengths), IOV_MAX):  # one syscall per IOV_MAX spans
        count = min(IOV_MAX, len(lengths) - first)
        want = int(lengths[first:first + count].sum())
        got = readv(pid, local[first:].ctypes.data, count, remote[first:].ctypes.data, count, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise TransferError("spans", f"process_vm_readv: {os.strerror(err)} (errno {err})")
        copied += got
        if got != want:
            raise TransferError("spans", f"process_vm_readv copied {got} of {want} bytes (a source page is gone)")
    return copied


@functools.cache
def available() -> bool:
    """This process may copy with :func:`copy_spans` (Linux, and no seccomp filter refusing the call)."""
    source, target = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    try:
        copy_spans(np.array([target.ctypes.data + 8]), np.array([source.ctypes.data]), np.array([32]))
    except TransferError:
        return False
    return bool((target[8:40] == source[:32]).all() and not target[:8].any() and not target[40:].any())
