"""Open GPU memory an engine shares: CUDA IPC handles and CUDA VMM fds.

Both go through the CUDA libraries with ``ctypes`` (no CUDA build of torch
needed in the daemon):

* IPC: the 64-byte ``cudaIpcMemHandle_t`` of the engine's allocation (what
  ``torch`` produces when it shares a CUDA storage) is opened with
  ``cudaIpcOpenMemHandle``; the region starts ``offset`` bytes in.
* VMM: a POSIX fd exported with ``cuMemExportToShareableHandle`` arrives
  over the fd socket (see :mod:`kvxferd.service.engines.fdpass`), is imported with
  ``cuMemImportFromShareableHandle`` and mapped into a reserved range.

Without a CUDA driver both raise :class:`UnavailableError` naming the field;
``tests/gpu/`` exercises them on a machine with a GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

from kvxferd.cuda.driver import (CU_ACCESS_READWRITE, CU_HANDLE_TYPE_POSIX_FD, CU_LOCATION_DEVICE,
                                 IPC_HANDLE_BYTES, IPC_LAZY_ENABLE_PEER_ACCESS, VMM_GRANULARITY, AccessDesc, IpcHandle,
                                 Location, allocation_size, check_drv, check_rt, cuda, cudart)
from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.plan.groups import RegionMemory


@dataclass(eq=False)
class GpuMapping:
    """An opened GPU region; ``close`` after NIXL deregistered it."""

    memory: RegionMemory
    _close: object

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def _bare_ipc_handle(handle: bytes, field: str) -> bytes:
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


def open_ipc(handle: bytes, offset: int, num_bytes: int, device_id: int, field: str) -> GpuMapping:
    """Open a CUDA IPC handle; the region is ``[offset, offset + num_bytes)`` of the allocation."""
    handle = _bare_ipc_handle(handle, field)
    if offset < 0 or num_bytes <= 0 or device_id < 0:
        raise InvalidArgumentError(field, f"bad range or device: offset {offset}, {num_bytes} bytes, device {device_id}")
    lib = cudart(f"{field}.handle.cuda_ipc_handle")
    check_rt(lib, lib.cudaSetDevice(device_id), "cudaSetDevice", f"{field}.device_id")
    base = ctypes.c_void_p()
    check_rt(lib, lib.cudaIpcOpenMemHandle(ctypes.byref(base), IpcHandle.from_buffer_copy(handle),
                                                    IPC_LAZY_ENABLE_PEER_ACCESS),
              "cudaIpcOpenMemHandle", f"{field}.handle.cuda_ipc_handle")
    try:  # the region must lie inside the shared allocation: never expose the memory around it
        allocation_bytes = allocation_size(base.value, field)
        if offset + num_bytes > allocation_bytes:
            raise InvalidArgumentError(f"{field}.num_bytes", f"region [{offset}, {offset + num_bytes}) exceeds the "
                                                             f"shared allocation of {allocation_bytes} bytes")
    except BaseException:
        lib.cudaIpcCloseMemHandle(base)
        raise
    return GpuMapping(RegionMemory(base.value + offset, num_bytes, device_id), lambda: lib.cudaIpcCloseMemHandle(base))


_UUID_FORMAT = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


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
    """The index under which this daemon sees the engine's GPU.

    An engine and its daemon may see the same GPU under different indices
    (another ``CUDA_VISIBLE_DEVICES``), and index 0 of both may be two
    different GPUs: the UUID decides. Without one, the index is trusted.
    """
    if not device_uuid:
        return device_id
    if not _UUID_FORMAT.fullmatch(device_uuid):
        raise InvalidArgumentError(f"{field}.device_uuid", f"{device_uuid[:80]!r} is not a GPU UUID (GPU-xxxxxxxx-...)")
    uuids = visible(f"{field}.device_uuid")
    if device_uuid in uuids:
        return uuids.index(device_uuid)
    raise UnavailableError(f"{field}.device_uuid", f"the engine's GPU {device_uuid} is not visible to this daemon "
                                                   f"(it sees {uuids or 'no GPU'}): run the daemon on the engine's GPU, "
                                                   "e.g. with the same CUDA_VISIBLE_DEVICES")


def import_vmm(fd: int, offset: int, num_bytes: int, device_id: int, field: str, *,
               allocation_bytes: int = 0) -> GpuMapping:
    """Import a VMM shareable fd and map all of it read-write on ``device_id``; always closes ``fd``.

    CUDA maps whole allocations only, so the engine names the allocation's
    size (``allocation_bytes``; 0: the region ends where it does); the
    driver refuses a size that is not the allocation's, and the region must
    lie inside it.
    """
    try:
        return _import_vmm(fd, offset, num_bytes, device_id, field, allocation_bytes)
    finally:
        os.close(fd)  # an imported handle keeps the allocation alive without the fd


def _import_vmm(fd: int, offset: int, num_bytes: int, device_id: int, field: str, allocation_bytes: int) -> GpuMapping:
    if offset < 0 or num_bytes <= 0 or device_id < 0:
        raise InvalidArgumentError(field, f"bad range or device: offset {offset}, {num_bytes} bytes, device {device_id}")
    if allocation_bytes and offset + num_bytes > allocation_bytes:
        raise InvalidArgumentError(f"{field}.num_bytes", f"region [{offset}, {offset + num_bytes}) exceeds the shared "
                                                         f"allocation of {allocation_bytes} bytes")
    f = f"{field}.handle.cuda_vmm_fd_index"
    lib = cuda(f)
    check_drv(lib.cuInit(0), "cuInit", f)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check_drv(lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet", f"{field}.device_id")
    check_drv(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain", f)
    check_drv(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent", f)
    handle = ctypes.c_ulonglong()
    check_drv(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), CU_HANDLE_TYPE_POSIX_FD),
               "cuMemImportFromShareableHandle", f)
    size = allocation_bytes or -(-(offset + num_bytes) // VMM_GRANULARITY) * VMM_GRANULARITY
    base = ctypes.c_ulonglong()
    undo = [lambda: lib.cuMemRelease(handle)]  # run in reverse on failure, and by close()
    try:
        check_drv(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve", f)
        undo.append(lambda: lib.cuMemAddressFree(base, ctypes.c_size_t(size)))
        # cuMemMap maps whole allocations: any other size (a wrong allocation_bytes) is refused.
        code = lib.cuMemMap(base, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        if code != 0:
            raise InvalidArgumentError(f"{field}.handle.allocation_bytes", f"{size} bytes is not the size of the shared "
                                                                           f"allocation (cuMemMap CUresult {code})")
        undo.append(lambda: lib.cuMemUnmap(base, ctypes.c_size_t(size)))
        access = AccessDesc(Location(CU_LOCATION_DEVICE, device_id), CU_ACCESS_READWRITE)
        check_drv(lib.cuMemSetAccess(base, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
                   "cuMemSetAccess", f)
    except BaseException:
        for step in reversed(undo):
            step()
        raise

    def close() -> None:
        for step in reversed(undo):
            step()

    return GpuMapping(RegionMemory(base.value + offset, num_bytes, device_id), close)
