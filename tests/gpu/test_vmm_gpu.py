"""RDMA-capable shareable VMM memory on a real GPU (issue #56): the engine's allocator, the fd, the daemon's
import and verdict, and the vLLM connector's pool inside torch's MemPool. Skipped without a GPU."""

import ctypes

import numpy as np
import pytest

import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

from kvxferd.client.gpu import ShareableAllocator, export_region  # noqa: E402
from kvxferd.cuda.vmm import device_support  # noqa: E402
from kvxferd.integrations.vllm.vmmpool import KvCachePool  # noqa: E402
from kvxferd.service.engines.gpu import check_servable, import_vmm  # noqa: E402


def test_rdma_capable_allocation_shared_by_fd_on_a_gpu():
    torch.cuda.init()
    support = device_support(0)
    allocator = ShareableAllocator(0)
    address = allocator.allocate(4 << 20)
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    lib = allocator.lib
    assert lib.cuMemcpyHtoD_v2(ctypes.c_uint64(address), ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(4 << 20)) == 0
    export = export_region(address, 4 << 20)
    assert export.vmm_fd >= 0 and not export.ipc_handle  # IPC refuses VMM memory: shared as an fd
    assert export.rdma_capable == support.rdma_with_vmm  # read from the engine's own handle
    # An importer's handle shows no flags (H200, driver 580): the kind comes from the engine's word.
    mapping = import_vmm(export.vmm_fd, export.offset, 4 << 20, 0, "r", allocation_bytes=export.allocation_bytes,
                         rdma_capable=export.rdma_capable)
    try:
        seen = np.empty(4 << 20, np.uint8)
        assert lib.cuMemcpyDtoH_v2(ctypes.c_void_p(seen.ctypes.data), ctypes.c_uint64(mapping.memory.address),
                                   ctypes.c_size_t(4 << 20)) == 0
        assert np.array_equal(seen, data.numpy())
        assert mapping.kind == ("rdma_capable" if support.rdma_with_vmm else "not_rdma_capable")
        assert (check_servable(mapping, False, "r") == "") == support.rdma_with_vmm
    finally:
        mapping.close()
        allocator.free(address)


def test_rdma_capable_kv_cache_pool_in_torch():
    """What vLLM does with the connector's context: allocate the KV cache inside it; the tensor is the
    pool's VMM memory (exported as an fd), and torch frees it back to the pool."""
    pool = KvCachePool()
    with pool.context(torch):
        cache = torch.zeros(8 << 20, dtype=torch.int8, device="cuda")
    assert pool.allocated_bytes >= 8 << 20 and not pool.errors
    export = export_region(cache.data_ptr(), cache.numel())
    assert export.vmm_fd >= 0
    mapping = import_vmm(export.vmm_fd, export.offset, cache.numel(), 0, "r", allocation_bytes=export.allocation_bytes)
    mapping.close()
    cache.fill_(3)
    torch.cuda.synchronize()
    assert int(cache.sum()) == 3 * (8 << 20)
