"""Engine side: share GPU cache regions with a daemon, as CUDA IPC handles or CUDA VMM fds.

The daemon opens what this exports (:mod:`kvxferd.service.engines.gpu`); a VMM fd
travels over the fd socket first (:func:`kvxferd.client.fdsend.send_fds`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from kvxferd.cuda.driver import (CU_HANDLE_TYPE_POSIX_FD, IPC_HANDLE_BYTES, IpcHandle, address_range, check_drv,
                                 check_rt, cuda, cudart)
from kvxferd.cuda.vmm import ShareableAllocator, allocation_capabilities  # the allocator: re-exported
from kvxferd.errors import InvalidArgumentError

__all__ = ["GpuExport", "ShareableAllocator", "export_ipc", "export_region", "export_vmm"]

def export_ipc(address: int, field: str = "address") -> tuple[bytes, int]:
    """Engine side: the 64-byte IPC handle of the allocation holding ``address``, and ``address``'s offset in it.

    Works on any ``cudaMalloc`` memory, e.g. ``tensor.data_ptr()`` of a torch
    tensor (torch's own ``_share_cuda_()`` handle is an encoding of its own,
    not a bare ``cudaIpcMemHandle_t``). Needs the device's context current,
    as it is in a process that allocated on it.
    """
    lib = cudart(field)
    base, _size = address_range(address, field)
    handle = IpcHandle()
    check_rt(lib, lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "cudaIpcGetMemHandle", field)
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES), address - base


@dataclass(frozen=True)
class GpuExport:
    """How an engine shares one GPU region: a CUDA IPC handle, or a VMM allocation's fd (then it owns the fd)."""

    offset: int  # of the region in the allocation
    ipc_handle: bytes = b""
    vmm_fd: int = -1
    allocation_bytes: int = 0  # VMM: the allocation's size (the daemon maps all of it)
    # VMM: made with gpuDirectRDMACapable, read from the engine's own handle. The daemon is told: the driver
    # shows an importer zeroed flags (measured on an H200, driver 580), so it cannot read this itself.
    rdma_capable: bool = False


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
        cudart(field).cudaGetLastError()  # the refusal must not stay behind as the engine's last CUDA error
        try:
            return export_vmm(address, num_bytes, field)
        except InvalidArgumentError as vmm:
            raise InvalidArgumentError(field, f"{ipc.message}; as a VMM allocation: {vmm.message}") from None


def export_vmm(address: int, num_bytes: int, field: str = "address", lib=None) -> GpuExport:
    """Engine side: a POSIX fd of the VMM allocation holding the region (``cuMemRetainAllocationHandle``).
    The allocation must have been made exportable as one (:class:`kvxferd.cuda.vmm.ShareableAllocator`)."""
    lib = lib or cuda(field)
    if isinstance(lib, ctypes.CDLL):
        lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
        lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int,
                                                     ctypes.c_ulonglong]
    handle = ctypes.c_ulonglong()
    check_drv(lib.cuMemRetainAllocationHandle(ctypes.byref(handle), address), "cuMemRetainAllocationHandle", field)
    try:
        base, size = address_range(address, field, lib)
        if address + num_bytes > base + size:
            raise InvalidArgumentError(field, f"the region of {num_bytes} bytes runs past its allocation of {size} bytes "
                                              "(a cache over several allocations, such as torch's expandable segments, "
                                              "cannot be shared as one region)")
        rdma_capable = allocation_capabilities(handle.value, lib, field).rdma_capable
        fd = ctypes.c_int()
        check_drv(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, CU_HANDLE_TYPE_POSIX_FD, 0),
                   "cuMemExportToShareableHandle", field)
    finally:
        lib.cuMemRelease(handle)  # the retain took a reference; the allocation lives on in the engine
    return GpuExport(address - base, vmm_fd=fd.value, allocation_bytes=size, rdma_capable=rdma_capable)
