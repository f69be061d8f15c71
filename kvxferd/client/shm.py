"""Engine caches in POSIX shared memory, and how to describe them to the daemon."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.groups import EngineCache
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import engine_to_pb


class SharedArena:
    """One shared-memory object an engine allocates its cache regions in."""

    def __init__(self, num_bytes: int) -> None:
        self._shm = shared_memory.SharedMemory(create=True, size=max(num_bytes, 1))
        self.name = self._shm.name
        self.array = np.ndarray((num_bytes,), dtype=np.uint8, buffer=self._shm.buf)

    def allocate(self, num_bytes: int) -> np.ndarray:
        """The whole arena as the buffer of ``num_bytes`` (one arena per engine rank)."""
        if num_bytes > len(self.array):
            raise InvalidArgumentError("num_bytes", f"{num_bytes} bytes do not fit the arena of {len(self.array)}")
        return self.array[:num_bytes]

    def close(self) -> None:
        """Drop the mapping and remove the object (the daemon must have deregistered)."""
        self.array = np.zeros(0, dtype=np.uint8)
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


def engine_rank_pb(cache: EngineCache, arena: SharedArena) -> pb.EngineRank:
    """``cache`` (whose regions lie inside ``arena``) as a Register message with shm handles."""
    message = engine_to_pb(cache, with_addresses=False)
    base, end = arena.array.ctypes.data, arena.array.ctypes.data + arena.array.nbytes
    for group_pb, memory in zip(message.groups, cache.memory):
        for region_pb, region in zip(group_pb.regions, memory):
            if not (base <= region.address and region.address + region.num_bytes <= end):
                raise InvalidArgumentError("cache.memory", "a region lies outside the shared arena")
            region_pb.handle.shm_name = arena.name
            region_pb.handle.offset = region.address - base
    return message
