"""The connector's KV-cache pool, called as torch calls it (through its raw function pointers), on the played
driver: RDMA-capable fd-shareable allocations, freed on free, a failure a null pointer (never an exception
into torch), and the allocation exported as an fd the way register_kv_caches shares it."""

from __future__ import annotations

import ctypes

import numpy as np

from kvxferd.client.gpu import export_vmm
from kvxferd.cuda.vmm import ATTR_RDMA_WITH_VMM, HANDLE_POSIX_FD
from kvxferd.integrations.vllm.settings import load_settings
from kvxferd.integrations.vllm.vmmpool import ALLOC_FN, FREE_FN, KvCachePool
from kvxferd.service.engines.gpu import import_vmm
from tests.cuda.vmm_driver import GRANULE, PlayedVmmDriver


def as_torch_calls(pool: KvCachePool):
    alloc_ptr, free_ptr = pool.function_pointers
    return ALLOC_FN(alloc_ptr), FREE_FN(free_ptr)


def test_rdma_capable_kv_cache_pool_allocates_through_its_pointers():
    driver = PlayedVmmDriver()
    pool = KvCachePool(driver)
    alloc, free = as_torch_calls(pool)
    address = alloc(5 << 20, 0, None)
    assert address and pool.allocated_bytes == 3 * GRANULE
    prop = driver.created[-1]
    assert prop.allocFlags.gpuDirectRDMACapable == 1 and prop.requestedHandleTypes & HANDLE_POSIX_FD
    ctypes.memset(address, 7, 5 << 20)  # the cache is writable where vLLM put it
    export = export_vmm(address, 5 << 20, lib=driver)  # what register_kv_caches does after IPC refuses it
    assert export.rdma_capable  # what the connector tells the daemon (MemoryHandle.rdma_capable)
    mapping = import_vmm(export.vmm_fd, export.offset, 5 << 20, 0, "r", allocation_bytes=3 * GRANULE,
                         rdma_capable=export.rdma_capable, lib=driver)
    try:
        assert mapping.kind == "rdma_capable"
        seen = np.ctypeslib.as_array((ctypes.c_uint8 * (5 << 20)).from_address(mapping.memory.address))
        assert (seen == 7).all()
    finally:
        mapping.close()
    free(address, 5 << 20, 0, None)
    assert pool.allocated_bytes == 0 and not driver.mapped


def test_rdma_capable_kv_cache_pool_control_on_a_device_without_it():
    """The negative control: a device that cannot make RDMA-capable VMM memory. require_rdma_vmm: the
    allocation fails as torch expects (a null pointer) and says why; shareable_vmm: it is made without the
    flag (and the daemon will warn about it)."""
    strict = KvCachePool(PlayedVmmDriver(**{f"a{ATTR_RDMA_WITH_VMM}": 0}), require_rdma=True)
    alloc, _ = as_torch_calls(strict)
    assert alloc(GRANULE, 0, None) is None
    assert "cannot make RDMA-capable VMM memory" in strict.errors[0]
    driver = PlayedVmmDriver(**{f"a{ATTR_RDMA_WITH_VMM}": 0})
    lenient = KvCachePool(driver)
    alloc, free = as_torch_calls(lenient)
    address = alloc(GRANULE, 0, None)
    assert address and driver.created[-1].allocFlags.gpuDirectRDMACapable == 0
    free(address, GRANULE, 0, None)


def test_rdma_capable_kv_cache_memory_setting():
    assert load_settings({}).kv_cache_memory == "torch"
    assert load_settings({"kv_cache_memory": "shareable_vmm"}).kv_cache_memory == "shareable_vmm"
