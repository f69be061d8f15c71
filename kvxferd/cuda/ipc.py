"""CUDA IPC allocations and GPU identities, for a daemon that opens another process's GPU memory.

Two readers of an engine's cache open it this way: its own daemon (to
register it with NIXL, :mod:`kvxferd.service.engines.gpu`) and, for a
same-host read (issue #37), the reading daemon, which copies the planned
spans itself (:mod:`kvxferd.xfer.samehost.devicemaps`). A GPU is named by its UUID:
two processes may see it under different indices.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.cuda.driver import (IPC_HANDLE_BYTES, IPC_LAZY_ENABLE_PEER_ACCESS, IpcHandle, allocation_size, check_drv,
                                 check_rt, cuda, cudart)
from kvxferd.errors import InvalidArgumentError, UnavailableError


def bare_ipc_handle(handle: bytes, field: str) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t``; also accepts torch's ``_share_cuda_()`` encoding of one.

    torch prefixes the handle with two bytes (a format version and ``c`` for
    a cudaMalloc block); ``e`` (an expandable segment) is not a CUDA IPC
    handle at all and is refused.
    """
    if len(handle) == IPC_HANDLE_BYTES:
        return handle
    if len(handle) == IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:]
    hint = " (torch expandable segments: share with cudaMalloc'd memory or a VMM fd)" if handle[1:2] == b"e" else ""
    raise InvalidArgumentError(f"{field}.handle.cuda_ipc_handle", f"{len(handle)} bytes, a CUDA IPC handle has "
                                                                  f"{IPC_HANDLE_BYTES}{hint}")


@dataclass(eq=False)
class IpcAllocation:
    """Another process's allocation, opened here: its base address and size; ``close`` once unused."""

    base: int
    num_bytes: int
    _close: Callable[[], object] | None

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def open_ipc_allocation(handle: bytes, device_id: int, field: str) -> IpcAllocation:
    """Open a bare 64-byte CUDA IPC handle on ``device_id`` (peer access to it enabled lazily)."""
    lib = cudart(f"{field}.handle.cuda_ipc_handle")
    check_rt(lib, lib.cudaSetDevice(device_id), "cudaSetDevice", f"{field}.device_id")
    base = ctypes.c_void_p()
    check_rt(lib, lib.cudaIpcOpenMemHandle(ctypes.byref(base), IpcHandle.from_buffer_copy(handle),
                                           IPC_LAZY_ENABLE_PEER_ACCESS),
             "cudaIpcOpenMemHandle", f"{field}.handle.cuda_ipc_handle")
    try:
        num_bytes = allocation_size(base.value, field)
    except BaseException:
        lib.cudaIpcCloseMemHandle(base)
        raise
    return IpcAllocation(base.value, num_bytes, lambda: lib.cudaIpcCloseMemHandle(base))


_UUID_FORMAT = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_gpu_uuid(text: str) -> bool:
    """Whether ``text`` is a GPU UUID in nvidia-smi's form."""
    return bool(_UUID_FORMAT.fullmatch(text))


def format_uuid(raw: bytes) -> str:
    """``GPU-`` and the 16 bytes of a ``CUuuid`` as 8-4-4-4-12 hex (nvidia-smi's form)."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def visible_device_uuids(field: str) -> list[str]:
    """UUIDs of the GPUs this process sees, by index (``cuDeviceGetUuid``)."""
    lib = cuda(field)
    check_drv(lib.cuInit(0), "cuInit", field)
    count = ctypes.c_int()
    check_drv(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount", field)
    uuids = []
    for index in range(count.value):
        device, raw = ctypes.c_int(), (ctypes.c_char * 16)()
        check_drv(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet", field)
        check_drv(lib.cuDeviceGetUuid(raw, device), "cuDeviceGetUuid", field)
        uuids.append(format_uuid(bytes(raw)))
    return uuids


def resolve_device(device_id: int, device_uuid: str, field: str, *, visible=visible_device_uuids) -> int:
    """The index under which this process sees the GPU named ``device_uuid``.

    An engine and its daemon may see the same GPU under different indices
    (another ``CUDA_VISIBLE_DEVICES``), and index 0 of both may be two
    different GPUs: the UUID decides. Without one, the index is trusted.
    """
    if not device_uuid:
        return device_id
    if not is_gpu_uuid(device_uuid):
        raise InvalidArgumentError(f"{field}.device_uuid", f"{device_uuid[:80]!r} is not a GPU UUID (GPU-xxxxxxxx-...)")
    uuids = visible(f"{field}.device_uuid")
    if device_uuid in uuids:
        return uuids.index(device_uuid)
    raise UnavailableError(f"{field}.device_uuid", f"the engine's GPU {device_uuid} is not visible to this daemon "
                                                   f"(it sees {uuids or 'no GPU'}): run the daemon on the engine's GPU, "
                                                   "e.g. with the same CUDA_VISIBLE_DEVICES")
