"""CUDA's VMM calls played on host memory: physical allocations are memfds, mappings are real mmaps.

An address reserved with ``cuMemAddressReserve`` is a PROT_NONE range of
this process; ``cuMemMap`` maps the allocation's memfd over it (MAP_FIXED),
so two mappings of one allocation alias as device mappings do. Exported
handles are copies of the memfd; an import finds its allocation by the
memfd's inode. The properties an allocation was created with are kept and
read back from the creator's handles; an imported handle reads back zeroed flags and handle types, as
driver 580 does on an H200 (measured, docs/gpu.md): the importer cannot see gpuDirectRDMACapable.
"""

from __future__ import annotations

import ctypes
import os

from kvxferd.cuda.vmm import (ATTR_DMA_BUF, ATTR_FABRIC, ATTR_POSIX_FD, ATTR_RDMA_WITH_VMM, ATTR_VMM, HANDLE_FABRIC,
                              AllocationProp)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 1, 2, 0x10, 0x20
GRANULE = 2 << 20
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED = 1, 800, 801


def _out(pointer):
    return pointer._obj  # ctypes.byref(x) -> x


def imported_view(prop: AllocationProp) -> AllocationProp:
    """What ``cuMemGetAllocationPropertiesFromHandle`` says of an imported handle: the type and location, with
    allocFlags and requestedHandleTypes zero (measured on an H200, driver 580.159)."""
    seen = AllocationProp()
    seen.type, seen.location = prop.type, prop.location
    return seen


class PlayedVmmDriver:
    """``attributes``: the device's answers (default: a data-center GPU with everything)."""

    def __init__(self, fabric_permitted: bool = True, **attributes: int) -> None:
        self.fabric_permitted = fabric_permitted  # False: no IMEX channel (cuMemCreate refuses FABRIC)
        self.attributes = {ATTR_VMM: 1, ATTR_POSIX_FD: 1, ATTR_RDMA_WITH_VMM: 1, ATTR_DMA_BUF: 1, ATTR_FABRIC: 0}
        self.attributes.update({int(k.removeprefix("a")): v for k, v in attributes.items()})
        self.created: list[AllocationProp] = []  # what each cuMemCreate was asked
        self.handles: dict[int, tuple[int, int, AllocationProp]] = {}  # handle -> (memfd, size, prop)
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (handle, size)
        self.released: list[int] = []
        self._next = 1

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, device, index):
        _out(device).value = index
        return 0

    def cuDeviceGetAttribute(self, value, attribute, device):
        _out(value).value = self.attributes.get(attribute, 0)
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):
        _out(context).value = 7000
        return 0

    def cuCtxSetCurrent(self, context):
        return 0

    def cuMemGetAllocationGranularity(self, granularity, prop, option):
        _out(granularity).value = GRANULE
        return 0

    def cuMemCreate(self, handle, size, prop, flags):
        prop = AllocationProp.from_buffer_copy(_out(prop))
        if prop.allocFlags.gpuDirectRDMACapable and not self.attributes[ATTR_RDMA_WITH_VMM]:
            return CUDA_ERROR_INVALID_VALUE  # as the driver refuses the flag on a device without it
        if prop.requestedHandleTypes & HANDLE_FABRIC and not self.fabric_permitted:
            return CUDA_ERROR_NOT_PERMITTED
        self.created.append(prop)
        memfd = os.memfd_create("played-vram")
        os.ftruncate(memfd, size.value)
        _out(handle).value = self._new_handle(memfd, size.value, prop)
        return 0

    def _new_handle(self, memfd, size, prop) -> int:
        self._next += 1
        self.handles[self._next] = (memfd, size, prop)
        return self._next

    def cuMemRelease(self, handle):
        handle = getattr(handle, "value", handle)
        memfd, _size, _prop = self.handles.pop(handle)
        os.close(memfd)  # the memory lives on while something maps it, as the driver's reference count does
        self.released.append(handle)
        return 0

    def cuMemAddressReserve(self, address, size, alignment, start, flags):
        _out(address).value = _libc.mmap(None, size.value, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        return 0

    def cuMemAddressFree(self, address, size):
        _libc.munmap(getattr(address, "value", address), getattr(size, "value", size))
        return 0

    def cuMemMap(self, address, size, offset, handle, flags):
        address, size, handle = (getattr(x, "value", x) for x in (address, size, handle))
        memfd, allocation_size, _prop = self.handles[handle]
        if size != allocation_size:
            return CUDA_ERROR_INVALID_VALUE  # whole allocations only
        _libc.mmap(address, size, PROT_RW, MAP_SHARED | MAP_FIXED, memfd, 0)
        self.mapped[address] = (handle, size)
        return 0

    def cuMemUnmap(self, address, size):
        address, size = getattr(address, "value", address), getattr(size, "value", size)
        _libc.mmap(address, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
        self.mapped.pop(address, None)
        return 0

    def cuMemSetAccess(self, address, size, descriptors, count):
        return 0

    def _allocation_at(self, address: int) -> tuple[int, int, int]:
        for base, (handle, size) in self.mapped.items():
            if base <= address < base + size:
                return base, handle, size
        raise KeyError(address)

    def cuMemRetainAllocationHandle(self, handle, address):
        try:
            _base, mapped_handle, _size = self._allocation_at(getattr(address, "value", address))
        except KeyError:
            return CUDA_ERROR_INVALID_VALUE
        memfd, size, prop = self.handles[mapped_handle]
        _out(handle).value = self._new_handle(os.dup(memfd), size, prop)  # a reference of its own
        return 0

    def cuMemGetAddressRange_v2(self, base, size, address):
        found_base, _handle, found_size = self._allocation_at(getattr(address, "value", address))
        _out(base).value, _out(size).value = found_base, found_size
        return 0

    def cuMemExportToShareableHandle(self, fd, handle, handle_type, flags):
        handle = getattr(handle, "value", handle)
        memfd, _size, prop = self.handles[handle]
        if not prop.requestedHandleTypes & handle_type:
            return CUDA_ERROR_NOT_SUPPORTED  # exportable only as the types asked at creation
        _out(fd).value = os.dup(memfd)
        return 0

    def cuMemImportFromShareableHandle(self, handle, fd, handle_type):
        fd = getattr(fd, "value", fd)
        inode = os.fstat(fd).st_ino
        for memfd, size, prop in list(self.handles.values()):
            if os.fstat(memfd).st_ino == inode:
                _out(handle).value = self._new_handle(os.dup(fd), size, imported_view(prop))
                return 0
        return CUDA_ERROR_INVALID_VALUE

    def cuMemGetAllocationPropertiesFromHandle(self, prop, handle):
        handle = getattr(handle, "value", handle)
        ctypes.memmove(ctypes.addressof(_out(prop)), ctypes.addressof(self.handles[handle][2]),
                       ctypes.sizeof(AllocationProp))
        return 0
