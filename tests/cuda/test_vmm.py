"""RDMA-capable shareable VMM memory, on the played driver: what the engine asks of cuMemCreate, the fd it
shares, the daemon's import and its verdict on what a NIC can serve.

The played driver keeps real memory behind each allocation (a memfd) and
maps it for real, so the engine's writes are seen through the daemon's
import: the fd sharing is checked byte for byte, not only its calls.
"""

from __future__ import annotations

import ctypes
import os
import logging

import numpy as np
import pytest

from kvxferd.client.gpu import export_vmm
from kvxferd.cuda.vmm import (ATTR_FABRIC, ATTR_RDMA_WITH_VMM, HANDLE_FABRIC, HANDLE_POSIX_FD, LEGACY_IPC,
                              AllocationProp, AllocFlags, ShareableAllocator, device_support)
from kvxferd.errors import UnavailableError
from kvxferd.plan.groups import RegionMemory
from kvxferd.service.engines.gpu import GpuMapping, check_servable, import_vmm
from tests.cuda.vmm_driver import GRANULE, PlayedVmmDriver


def written(address: int, num_bytes: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    ctypes.memmove(address, data.ctypes.data, num_bytes)
    return data


def read(address: int, num_bytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(address)).copy()


def test_rdma_capable_shareable_allocation_flags():
    driver = PlayedVmmDriver(**{f"a{ATTR_FABRIC}": 1})
    allocator = ShareableAllocator(0, driver)
    address = allocator.allocate(3 << 20)
    prop = driver.created[-1]
    assert prop.allocFlags.gpuDirectRDMACapable == 1
    assert prop.requestedHandleTypes == HANDLE_POSIX_FD | HANDLE_FABRIC
    assert prop.location.id == 0 and allocator.allocated_bytes == 2 * GRANULE  # whole granules
    allocator.free(address)
    assert not driver.mapped and allocator.allocated_bytes == 0
    # The device can, this process may not (no IMEX channel): FABRIC is dropped, POSIX fds stay.
    driver = PlayedVmmDriver(fabric_permitted=False, **{f"a{ATTR_FABRIC}": 1})
    allocator = ShareableAllocator(0, driver)
    allocator.allocate(GRANULE)
    assert driver.created[-1].requestedHandleTypes == HANDLE_POSIX_FD


def test_rdma_capable_allocation_prop_has_the_drivers_layout():
    """CUmemAllocationProp as cuda.h lays it out on 64-bit Linux (the played driver shares the struct, so
    only this pins it): 32 bytes, location at 8, win32HandleMetaData at 16, allocFlags at 24."""
    assert ctypes.sizeof(AllocationProp) == 32
    assert (AllocationProp.location.offset, AllocationProp.win32HandleMetaData.offset,
            AllocationProp.allocFlags.offset) == (8, 16, 24)
    assert AllocFlags.gpuDirectRDMACapable.offset == 1 and ctypes.sizeof(AllocFlags) == 8


def test_rdma_capable_vram_shared_by_fd_is_the_engines_bytes():
    """Engine: allocate, write, export an fd. Daemon: import and map it. Same bytes, RDMA-capable; the engine
    freeing its mapping leaves the daemon's intact (the driver counts references). The engine reads the
    RDMA flag from its own handle and says so: an importer sees no flags (as on an H200), so without the
    engine's word the same memory is not_rdma_capable (the control)."""
    driver = PlayedVmmDriver()
    engine = ShareableAllocator(0, driver)
    address = engine.allocate(GRANULE)
    data = written(address + 4096, 65536, seed=1)
    export = export_vmm(address + 4096, 65536, lib=driver)
    assert export.offset == 4096 and export.allocation_bytes == GRANULE and export.rdma_capable
    unsaid = import_vmm(os.dup(export.vmm_fd), export.offset, 65536, 0, "r", allocation_bytes=GRANULE, lib=driver)
    assert unsaid.kind == "not_rdma_capable"
    unsaid.close()
    mapping = import_vmm(export.vmm_fd, export.offset, 65536, 0, "r", allocation_bytes=GRANULE,
                         rdma_capable=export.rdma_capable, lib=driver)
    try:
        assert mapping.kind == "rdma_capable" and check_servable(mapping, True, "r") == ""
        assert mapping.memory.address != address + 4096  # its own mapping, of the same memory
        assert np.array_equal(read(mapping.memory.address, 65536), data)
        engine.free(address)
        assert np.array_equal(read(mapping.memory.address, 65536), data)
    finally:
        mapping.close()


def test_rdma_capable_control_without_the_flag_is_warned_or_refused(caplog):
    """The negative control: a device that cannot make RDMA-capable VMM memory. The engine's allocator warns
    (or refuses when asked to require it); the daemon's import sees the flag missing and warns, or refuses
    under require_rdma_capable_vram."""
    driver = PlayedVmmDriver(**{f"a{ATTR_RDMA_WITH_VMM}": 0})
    assert not device_support(0, driver).rdma_with_vmm
    with pytest.raises(UnavailableError, match="RDMA-capable"):
        ShareableAllocator(0, driver, require_rdma=True)
    with caplog.at_level(logging.WARNING):
        engine = ShareableAllocator(0, driver)
    assert "a NIC cannot read this KV cache" in caplog.text
    address = engine.allocate(GRANULE)
    assert driver.created[-1].allocFlags.gpuDirectRDMACapable == 0
    export = export_vmm(address, GRANULE, lib=driver)
    assert not export.rdma_capable
    mapping = import_vmm(export.vmm_fd, 0, GRANULE, 0, "r", allocation_bytes=GRANULE,
                         rdma_capable=export.rdma_capable, lib=driver)
    try:
        assert mapping.kind == "not_rdma_capable"
        assert "without gpuDirectRDMACapable" in check_servable(mapping, False, "r")
        with pytest.raises(UnavailableError, match="emulated over TCP"):
            check_servable(mapping, True, "r")
    finally:
        mapping.close()
        engine.free(address)


def test_rdma_capable_legacy_ipc_memory_is_named():
    mapping = GpuMapping(RegionMemory(1 << 20, 4096, 0), None)
    assert mapping.kind == LEGACY_IPC
    assert "CUDA IPC handle" in check_servable(mapping, False, "r")


def test_rdma_capable_fd_only_exports_what_was_asked():
    """An allocation made without POSIX_FD (vLLM's own cumem allocator) cannot be exported as an fd."""
    driver = PlayedVmmDriver()
    engine = ShareableAllocator(0, driver)
    engine.prop.requestedHandleTypes = 0
    address = engine.allocate(GRANULE)
    with pytest.raises(Exception, match="cuMemExportToShareableHandle"):
        export_vmm(address, GRANULE, lib=driver)
    engine.free(address)
