"""Open GPU memory an engine shares: CUDA IPC handles and CUDA VMM fds.

Both go through the CUDA libraries with ``ctypes`` (no CUDA build of torch
needed in the daemon):

* IPC: the 64-byte ``cudaIpcMemHandle_t`` of the engine's allocation (what
  ``torch`` produces when it shares a CUDA storage) is opened with
  ``cudaIpcOpenMemHandle``; the region starts ``offset`` bytes in.
* VMM: a POSIX fd exported with ``cuMemExportToShareableHandle`` arrives
  over the fd socket (see :mod:`kvxferd.service.fdpass`), is imported with
  ``cuMemImportFromShareableHandle`` and mapped into a reserved range.

Without a CUDA driver both raise :class:`UnavailableError` naming the field;
``tests/gpu/`` exercises them on a machine with a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass

from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.plan.groups import RegionMemory

IPC_HANDLE_BYTES = 64
VMM_GRANULARITY = 2 << 20  # CUDA's minimum mapping granularity on current GPUs
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_CU_HANDLE_TYPE_POSIX_FD = 1
_CU_LOCATION_DEVICE = 1
_CU_ACCESS_READWRITE = 3


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _load(names: tuple[str, ...], what: str, field: str) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library(what)
    if found:
        return ctypes.CDLL(found)
    raise UnavailableError(field, f"GPU memory needs the CUDA {what} library, which this daemon cannot load "
                                  "(no GPU driver on this machine?)")


def _cudart(field: str) -> ctypes.CDLL:
    lib = _load(("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"), "cudart", field)
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def _cuda(field: str) -> ctypes.CDLL:
    return _load(("libcuda.so.1", "libcuda.so"), "cuda", field)


# Codes that mean "no usable GPU here" rather than "bad handle": initialization
# error, insufficient driver, stub library, no device, driver mismatch.
_NO_GPU_RUNTIME = {3, 34, 35, 100, 803, 804}
_NO_GPU_DRIVER = {3, 34, 100, 803, 804}


def _check_rt(lib: ctypes.CDLL, code: int, call: str, field: str) -> None:
    if code != 0:
        kind = UnavailableError if code in _NO_GPU_RUNTIME else InvalidArgumentError
        raise kind(field, f"{call} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


def _check_drv(code: int, call: str, field: str) -> None:
    if code != 0:
        kind = UnavailableError if code in _NO_GPU_DRIVER else InvalidArgumentError
        raise kind(field, f"{call} failed with CUresult {code}")


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
    lib = _cudart(f"{field}.handle.cuda_ipc_handle")
    _check_rt(lib, lib.cudaSetDevice(device_id), "cudaSetDevice", f"{field}.device_id")
    base = ctypes.c_void_p()
    _check_rt(lib, lib.cudaIpcOpenMemHandle(ctypes.byref(base), _IpcHandle.from_buffer_copy(handle),
                                                    _IPC_LAZY_ENABLE_PEER_ACCESS),
              "cudaIpcOpenMemHandle", f"{field}.handle.cuda_ipc_handle")
    try:  # the region must lie inside the shared allocation: never expose the memory around it
        allocation_bytes = _allocation_bytes(base.value, field)
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
    lib = _cuda(field)
    _check_drv(lib.cuInit(0), "cuInit", field)
    count = ctypes.c_int()
    _check_drv(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount", field)
    uuids = []
    for index in range(count.value):
        device, raw = ctypes.c_int(), (ctypes.c_char * 16)()
        _check_drv(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet", field)
        _check_drv(lib.cuDeviceGetUuid(raw, device), "cuDeviceGetUuid", field)
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


def _address_range(address: int, field: str) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding ``address`` (``cuMemGetAddressRange``)."""
    drv = _cuda(field)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    _check_drv(drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange", field)
    return base.value, size.value


def _allocation_bytes(base: int, field: str) -> int:
    return _address_range(base, field)[1]


def export_ipc(address: int, field: str = "address") -> tuple[bytes, int]:
    """Engine side: the 64-byte IPC handle of the allocation holding ``address``, and ``address``'s offset in it.

    Works on any ``cudaMalloc`` memory, e.g. ``tensor.data_ptr()`` of a torch
    tensor (torch's own ``_share_cuda_()`` handle is an encoding of its own,
    not a bare ``cudaIpcMemHandle_t``). Needs the device's context current,
    as it is in a process that allocated on it.
    """
    lib = _cudart(field)
    base, _size = _address_range(address, field)
    handle = _IpcHandle()
    _check_rt(lib, lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "cudaIpcGetMemHandle", field)
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES), address - base


@dataclass(frozen=True)
class GpuExport:
    """How an engine shares one GPU region: a CUDA IPC handle, or a VMM allocation's fd (then it owns the fd)."""

    offset: int  # of the region in the allocation
    ipc_handle: bytes = b""
    vmm_fd: int = -1
    allocation_bytes: int = 0  # VMM: the allocation's size (the daemon maps all of it)


def export_region(address: int, num_bytes: int, field: str = "address") -> GpuExport:
    """Engine side: share ``[address, address + num_bytes)`` by CUDA IPC, else as a VMM allocation's fd.

    ``cudaIpcGetMemHandle`` refuses memory made with ``cuMemCreate`` (vLLM's
    sleep-mode allocator); that memory is shared by fd instead. A region
    over several allocations (torch's expandable segments) can be neither.
    """
    try:
        handle, offset = export_ipc(address, field)
        return GpuExport(offset, ipc_handle=handle)
    except InvalidArgumentError as ipc:
        _cudart(field).cudaGetLastError()  # the refusal must not stay behind as the engine's last CUDA error
        try:
            return export_vmm(address, num_bytes, field)
        except InvalidArgumentError as vmm:
            raise InvalidArgumentError(field, f"{ipc.message}; as a VMM allocation: {vmm.message}") from None


def export_vmm(address: int, num_bytes: int, field: str = "address") -> GpuExport:
    """Engine side: a POSIX fd of the VMM allocation holding the region (``cuMemRetainAllocationHandle``)."""
    lib = _cuda(field)
    lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
    lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong]
    handle = ctypes.c_ulonglong()
    _check_drv(lib.cuMemRetainAllocationHandle(ctypes.byref(handle), address), "cuMemRetainAllocationHandle", field)
    try:
        base, size = _address_range(address, field)
        if address + num_bytes > base + size:
            raise InvalidArgumentError(field, f"the region of {num_bytes} bytes runs past its allocation of {size} bytes "
                                              "(a cache over several allocations, such as torch's expandable segments, "
                                              "cannot be shared as one region)")
        fd = ctypes.c_int()
        _check_drv(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, _CU_HANDLE_TYPE_POSIX_FD, 0),
                   "cuMemExportToShareableHandle", field)
    finally:
        lib.cuMemRelease(handle)  # the retain took a reference; the allocation lives on in the engine
    return GpuExport(address - base, vmm_fd=fd.value, allocation_bytes=size)


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
    lib = _cuda(f)
    _check_drv(lib.cuInit(0), "cuInit", f)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check_drv(lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet", f"{field}.device_id")
    _check_drv(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain", f)
    _check_drv(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent", f)
    handle = ctypes.c_ulonglong()
    _check_drv(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _CU_HANDLE_TYPE_POSIX_FD),
               "cuMemImportFromShareableHandle", f)
    size = allocation_bytes or -(-(offset + num_bytes) // VMM_GRANULARITY) * VMM_GRANULARITY
    base = ctypes.c_ulonglong()
    undo = [lambda: lib.cuMemRelease(handle)]  # run in reverse on failure, and by close()
    try:
        _check_drv(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve", f)
        undo.append(lambda: lib.cuMemAddressFree(base, ctypes.c_size_t(size)))
        # cuMemMap maps whole allocations: any other size (a wrong allocation_bytes) is refused.
        code = lib.cuMemMap(base, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        if code != 0:
            raise InvalidArgumentError(f"{field}.handle.allocation_bytes", f"{size} bytes is not the size of the shared "
                                                                           f"allocation (cuMemMap CUresult {code})")
        undo.append(lambda: lib.cuMemUnmap(base, ctypes.c_size_t(size)))
        access = _AccessDesc(_Location(_CU_LOCATION_DEVICE, device_id), _CU_ACCESS_READWRITE)
        _check_drv(lib.cuMemSetAccess(base, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
                   "cuMemSetAccess", f)
    except BaseException:
        for step in reversed(undo):
            step()
        raise

    def close() -> None:
        for step in reversed(undo):
            step()

    return GpuMapping(RegionMemory(base.value + offset, num_bytes, device_id), close)
