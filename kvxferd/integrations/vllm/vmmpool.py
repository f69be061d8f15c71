"""The KV cache allocated as memory a NIC and the daemon can serve: vLLM's KV-cache pool on RDMA-capable VMM.

vLLM asks its KV connector for a memory-pool context before it allocates
the KV cache (``get_mem_pool_context``) and allocates inside it. Ours routes
those allocations to :class:`kvxferd.cuda.vmm.ShareableAllocator` through a
torch ``MemPool`` with a pluggable allocator whose two functions are ctypes
callbacks (no compiled library to ship)::

    vLLM: with connector.get_mem_pool_context(): torch.zeros(kv_bytes, device="cuda")
            └─► MemPool ─► alloc_fn(size, device, stream) ─► cuMemCreate(gpuDirectRDMACapable, POSIX_FD)
                                                               + reserve + map + access
    register_kv_caches ─► export_region: cudaIpcGetMemHandle refuses VMM memory ─► export_vmm: an fd
                       ─► the fd socket ─► the daemon imports, maps and registers it (engines/gpu.py)

Only the KV cache goes there (the context ends with its allocation); the
engine's cache outlives its daemon and is passed again to the next one.
Everything but the torch glue runs on the played driver of ``tests/cuda``.
"""

from __future__ import annotations

import ctypes
import logging

from kvxferd.client.gpu import ShareableAllocator

log = logging.getLogger(__name__)

# torch's pluggable-allocator signatures: void* alloc(ssize_t, int device, cudaStream_t);
# void free(void*, ssize_t, int device, cudaStream_t).
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class KvCachePool:
    """Allocates the KV cache as RDMA-capable, fd-shareable VMM memory, one allocator per device.

    ``require_rdma``: a device that cannot make RDMA-capable VMM memory fails
    the allocation (vLLM then fails to start) instead of warning.
    """

    def __init__(self, lib=None, *, require_rdma: bool = False) -> None:
        self.lib, self.require_rdma = lib, require_rdma
        self.allocators: dict[int, ShareableAllocator] = {}
        self.errors: list[str] = []  # a callback cannot raise into torch: what failed, for the caller to say
        # Kept on the instance: torch holds only the raw pointers, and a collected callback would crash it.
        self._alloc_fn, self._free_fn = ALLOC_FN(self._alloc), FREE_FN(self._free)

    @property
    def function_pointers(self) -> tuple[int, int]:
        """``(alloc, free)`` as torch's ``_cuda_customAllocator`` takes them."""
        return (ctypes.cast(self._alloc_fn, ctypes.c_void_p).value, ctypes.cast(self._free_fn, ctypes.c_void_p).value)

    @property
    def allocated_bytes(self) -> int:
        return sum(allocator.allocated_bytes for allocator in self.allocators.values())

    def _alloc(self, num_bytes: int, device: int, stream) -> int | None:
        try:
            if device not in self.allocators:
                self.allocators[device] = ShareableAllocator(device, self.lib, require_rdma=self.require_rdma)
            return self.allocators[device].allocate(num_bytes)
        except Exception as err:  # noqa: BLE001 - torch sees a null pointer (out of memory) and raises
            self.errors.append(f"{type(err).__name__}: {err}")
            log.error("kvxferd: the KV cache could not be allocated as shareable VMM memory: %s", err)
            return None

    def _free(self, address: int, num_bytes: int, device: int, stream) -> None:
        if "allocators" not in vars(self):
            return  # interpreter shutdown tore this pool down before torch freed its last segment: the exit frees it
        try:
            self.allocators[device].free(address)
        except Exception as err:  # noqa: BLE001 - never raise into torch
            log.error("kvxferd: freeing a KV cache allocation failed: %s", err)

    def context(self, torch):
        """The context vLLM allocates the KV cache in (a CUDA build of torch)."""
        pool = torch.cuda.MemPool(torch._C._cuda_customAllocator(*self.function_pointers))
        self._pool = pool  # alive as long as the cache: its segments are freed with it
        return torch.cuda.use_mem_pool(pool)
