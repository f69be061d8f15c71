"""GPU memory a NIC and UCX can serve from another process: RDMA-capable, shareable CUDA VMM allocations.

The memory model (docs/gpu.md): the engine allocates its KV cache with
``cuMemCreate`` asking for ``gpuDirectRDMACapable`` (where the device reports
``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED``) and a
shareable handle (a POSIX fd; FABRIC too where the device can, for NVLink
domains across hosts). It passes the fd to its daemon over the fd socket; the
daemon imports, maps, and registers the mapping with NIXL (registration
follows the final mapping). The allocation is reference-counted by the
driver: the engine's cache outlives a daemon that dies, and is passed again
to the next one.

:class:`ShareableAllocator` is the engine's side (the vLLM connector's KV
cache pool, :mod:`kvxferd.integrations.vllm.vmmpool`);
:func:`allocation_capabilities` is the daemon's check of what it imported.
Both take the driver library as an argument, so the played driver of
``tests/cuda`` stands in for it without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

from kvxferd.cuda.driver import CU_ACCESS_READWRITE, CU_LOCATION_DEVICE, AccessDesc, Location, check_drv, cuda
from kvxferd.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)

CU_ALLOCATION_TYPE_PINNED = 1
HANDLE_POSIX_FD, HANDLE_FABRIC = 1, 8  # CUmemAllocationHandleType bits
GRANULARITY_RECOMMENDED = 1
# CUdevice_attribute numbers
ATTR_VMM = 102
ATTR_POSIX_FD = 103
ATTR_RDMA_WITH_VMM = 110
ATTR_DMA_BUF = 124
ATTR_FABRIC = 128


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (v1)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


@dataclass(frozen=True)
class DeviceSupport:
    """What a GPU offers for memory another process (or a NIC) is to use."""

    vmm: bool
    posix_fd: bool
    rdma_with_vmm: bool  # gpuDirectRDMACapable may be asked of cuMemCreate
    dma_buf: bool  # cuMemGetHandleForAddressRange(DMA_BUF_FD): registration without nvidia-peermem
    fabric: bool  # FABRIC handles (multi-node NVLink, IMEX)


def device_support(device_id: int, lib=None, field: str = "device_id") -> DeviceSupport:
    """Ask the driver what device ``device_id`` supports."""
    lib = lib or cuda(field)
    check_drv(lib.cuInit(0), "cuInit", field)
    device = ctypes.c_int()
    check_drv(lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet", field)

    def attribute(number: int) -> bool:
        value = ctypes.c_int()
        return lib.cuDeviceGetAttribute(ctypes.byref(value), number, device) == 0 and value.value != 0

    return DeviceSupport(attribute(ATTR_VMM), attribute(ATTR_POSIX_FD), attribute(ATTR_RDMA_WITH_VMM),
                         attribute(ATTR_DMA_BUF), attribute(ATTR_FABRIC))


@dataclass(frozen=True)
class MemoryCapabilities:
    """What an allocation was made able to do (read back from its handle)."""

    rdma_capable: bool
    handle_types: int  # HANDLE_* bits

    @property
    def kind(self) -> str:
        """A bounded label: ``rdma_capable``, or ``not_rdma_capable`` (a NIC cannot register it)."""
        return "rdma_capable" if self.rdma_capable else "not_rdma_capable"


LEGACY_IPC = "legacy_ipc"  # cudaMalloc memory opened from an IPC handle: neither a NIC nor UCX's cuda_ipc can serve it
MEMORY_KINDS = ("rdma_capable", "not_rdma_capable", LEGACY_IPC)


def allocation_capabilities(handle: int, lib, field: str) -> MemoryCapabilities:
    """``cuMemGetAllocationPropertiesFromHandle``: whether the allocation is RDMA-capable, and its handle types."""
    prop = AllocationProp()
    check_drv(lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), ctypes.c_ulonglong(handle)),
              "cuMemGetAllocationPropertiesFromHandle", field)
    return MemoryCapabilities(bool(prop.allocFlags.gpuDirectRDMACapable), prop.requestedHandleTypes)


def allocation_prop(device_id: int, support: DeviceSupport) -> AllocationProp:
    """What the engine asks of ``cuMemCreate``: pinned device memory, exportable as a POSIX fd (and FABRIC where
    the device can), RDMA-capable where the device can."""
    prop = AllocationProp()
    prop.type = CU_ALLOCATION_TYPE_PINNED
    prop.location = Location(CU_LOCATION_DEVICE, device_id)
    prop.requestedHandleTypes = HANDLE_POSIX_FD | (HANDLE_FABRIC if support.fabric else 0)
    prop.allocFlags.gpuDirectRDMACapable = 1 if support.rdma_with_vmm else 0
    return prop


class ShareableAllocator:
    """Allocates RDMA-capable, fd-shareable device memory (``cuMemCreate`` + reserve + map + access).

    ``require_rdma``: refuse (UnavailableError: FAILED_PRECONDITION) on a device that cannot make
    RDMA-capable VMM memory, instead of allocating memory a NIC cannot read
    (the warning otherwise says so, once).
    """

    def __init__(self, device_id: int, lib=None, *, require_rdma: bool = False) -> None:
        self.device_id = device_id
        self.lib = lib or cuda("device_id")
        self.support = device_support(device_id, self.lib)
        if not (self.support.vmm and self.support.posix_fd):
            raise UnavailableError("device_id", f"GPU {device_id} cannot make shareable VMM memory "
                                                       "(no virtual memory management or POSIX fd handles)")
        if not self.support.rdma_with_vmm:
            message = (f"GPU {device_id} cannot make RDMA-capable VMM memory: a NIC cannot read this KV cache, "
                       "reads from other hosts would be emulated over TCP")
            if require_rdma:
                raise UnavailableError("device_id", message)
            log.warning(message)
        self.prop = allocation_prop(device_id, self.support)
        granularity = ctypes.c_size_t()
        if self.prop.requestedHandleTypes & HANDLE_FABRIC and not self._fabric_permitted():
            self.prop.requestedHandleTypes &= ~HANDLE_FABRIC
        check_drv(self.lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop),
                                                         GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity",
                  "device_id")
        self.granularity = granularity.value
        self.allocations: dict[int, tuple[int, int]] = {}  # address -> (handle, size)

    def _fabric_permitted(self) -> bool:
        """Whether this process may create FABRIC-exportable memory: the device attribute says the device can,
        but without an IMEX channel cuMemCreate refuses it (NOT_PERMITTED); then POSIX fds alone."""
        granularity, handle = ctypes.c_size_t(), ctypes.c_ulonglong()
        if self.lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop),
                                                  GRANULARITY_RECOMMENDED) != 0:
            return False
        code = self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(granularity.value), ctypes.byref(self.prop),
                                    ctypes.c_ulonglong(0))
        if code != 0:
            log.info("FABRIC handles refused here (CUresult %d, no IMEX channel?): POSIX fds only", code)
            return False
        self.lib.cuMemRelease(handle)
        return True

    @property
    def allocated_bytes(self) -> int:
        return sum(size for _handle, size in self.allocations.values())

    def allocate(self, num_bytes: int) -> int:
        """A mapped, read-write device address of at least ``num_bytes`` (whole granules)."""
        lib, size = self.lib, -(-max(num_bytes, 1) // self.granularity) * self.granularity
        handle = ctypes.c_ulonglong()
        check_drv(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                                  ctypes.c_ulonglong(0)), "cuMemCreate", "num_bytes")
        undo = [lambda: lib.cuMemRelease(handle)]
        try:
            base = map_whole(lib, handle, size, self.device_id, "num_bytes", undo)
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        self.allocations[base] = (handle.value, size)
        return base

    def free(self, address: int) -> None:
        """Unmap and release an allocation of this allocator (the memory lives on while a daemon maps it)."""
        handle, size = self.allocations.pop(address)
        self.lib.cuMemUnmap(ctypes.c_ulonglong(address), ctypes.c_size_t(size))
        self.lib.cuMemAddressFree(ctypes.c_ulonglong(address), ctypes.c_size_t(size))
        self.lib.cuMemRelease(ctypes.c_ulonglong(handle))


@dataclass(eq=False)
class ImportedAllocation:
    """Another process's VMM allocation, imported and mapped read-write here; ``close`` once unused."""

    base: int
    num_bytes: int
    capabilities: MemoryCapabilities
    _undo: list

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()


def make_current(lib, device_id: int, field: str) -> None:
    """Make ``device_id``'s primary context current on this thread (a driver call that maps or copies needs one)."""
    check_drv(lib.cuInit(0), "cuInit", field)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check_drv(lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet", field)
    check_drv(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain", field)
    check_drv(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent", field)


def map_whole(lib, handle: ctypes.c_ulonglong, num_bytes: int, device_id: int, field: str, undo: list,
              refused=None) -> int:
    """Reserve an address range, map all ``num_bytes`` of the allocation ``handle`` there and make it
    read-write on ``device_id``: its address. Each step's undo is appended to ``undo`` (the caller runs them
    in reverse). ``refused(code)``: the error for a cuMemMap the driver refuses (else a driver error)."""
    base = ctypes.c_ulonglong()
    check_drv(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(num_bytes), ctypes.c_size_t(0),
                                      ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve", field)
    undo.append(lambda: lib.cuMemAddressFree(base, ctypes.c_size_t(num_bytes)))
    code = lib.cuMemMap(base, ctypes.c_size_t(num_bytes), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    if code != 0 and refused is not None:
        raise refused(code)
    check_drv(code, "cuMemMap", field)
    undo.append(lambda: lib.cuMemUnmap(base, ctypes.c_size_t(num_bytes)))
    access = AccessDesc(Location(CU_LOCATION_DEVICE, device_id), CU_ACCESS_READWRITE)
    check_drv(lib.cuMemSetAccess(base, ctypes.c_size_t(num_bytes), ctypes.byref(access), ctypes.c_size_t(1)),
              "cuMemSetAccess", field)
    return base.value


def import_allocation(fd: int, num_bytes: int, device_id: int, field: str, lib=None) -> ImportedAllocation:
    """Import a POSIX-fd shareable handle (the caller keeps ``fd``) and map the whole allocation of
    ``num_bytes`` on ``device_id``; the driver refuses a size that is not the allocation's."""
    lib = lib or cuda(field)
    make_current(lib, device_id, field)
    handle = ctypes.c_ulonglong()
    check_drv(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_POSIX_FD),
              "cuMemImportFromShareableHandle", field)
    undo = [lambda: lib.cuMemRelease(handle)]  # run in reverse on failure, and by close()

    def wrong_size(code: int) -> InvalidArgumentError:  # cuMemMap maps whole allocations only
        return InvalidArgumentError(f"{field.rsplit('.', 1)[0]}.allocation_bytes", f"{num_bytes} bytes is not the "
                                    f"size of the shared allocation (cuMemMap CUresult {code})")

    try:
        capabilities = allocation_capabilities(handle.value, lib, field)
        base = map_whole(lib, handle, num_bytes, device_id, field, undo, refused=wrong_size)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return ImportedAllocation(base, num_bytes, capabilities, undo)
