"""Open the memory an engine hands over, so NIXL can register it.

Host memory arrives as the name of a POSIX shared-memory object. The daemon
maps it read-write (``/dev/shm/<name>``) and keeps the mapping until the
engine deregisters. It deliberately avoids
``multiprocessing.shared_memory``: in Python < 3.13 that registers even an
attached segment with the resource tracker, which would unlink the engine's
cache when the daemon exits.

GPU memory (CUDA IPC handles, CUDA VMM fds) is opened by
:mod:`kvxferd.service.gpu`.
"""

from __future__ import annotations

import mmap
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, NotFoundError
from kvxferd.plan.groups import RegionMemory
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service import gpu

SHM_DIR = pathlib.Path("/dev/shm")


@dataclass(eq=False)
class MappedRegion:
    """One mapped region: its bytes (a numpy view) and where they live."""

    name: str
    array: np.ndarray  # uint8 view of the region
    _mapping: mmap.mmap = field(repr=False)

    @property
    def memory(self) -> RegionMemory:
        return RegionMemory(self.array.ctypes.data, self.array.nbytes)

    def close(self) -> None:
        """Unmap (after NIXL deregistered it; no view may outlive this)."""
        self.array = np.zeros(0, dtype=np.uint8)
        self._mapping.close()


def map_shm(name: str, offset: int, num_bytes: int, field: str) -> MappedRegion:
    """Map ``num_bytes`` at ``offset`` of shared-memory object ``name``."""
    if not name or "/" in name.strip("/") or name in (".", ".."):
        raise InvalidArgumentError(f"{field}.shm_name", f"not a shared-memory object name: {name!r}")
    if offset < 0 or num_bytes <= 0:
        raise InvalidArgumentError(field, f"bad range: offset {offset}, {num_bytes} bytes")
    path = SHM_DIR / name.strip("/")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise NotFoundError(f"{field}.shm_name", f"no shared-memory object {name!r}") from None
    except PermissionError:
        raise InvalidArgumentError(f"{field}.shm_name", f"shared-memory object {name!r} is not readable and writable") from None
    try:
        size = os.fstat(fd).st_size
        if offset + num_bytes > size:
            raise InvalidArgumentError(field, f"region [{offset}, {offset + num_bytes}) exceeds {name!r} of {size} bytes")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8, count=num_bytes, offset=offset)
    return MappedRegion(name, array, mapping)


def open_region(region: pb.Region, num_bytes: int, mem_type: str, field: str, fds: Sequence[int] = ()):
    """Open one region of a Register request; returns an object with ``memory`` and ``close()``."""
    source = region.handle.WhichOneof("source")
    want = {"shm_name": "DRAM", "cuda_ipc_handle": "VRAM", "cuda_vmm_fd_index": "VRAM"}.get(source)
    if source is None:
        raise InvalidArgumentError(f"{field}.handle", "a region needs a memory handle")
    if mem_type != want:
        raise InvalidArgumentError(f"{field}.handle.{source}", f"a {source} handle is {want} memory, the engine says {mem_type}")
    offset = region.handle.offset
    if source == "shm_name":
        return map_shm(region.handle.shm_name, offset, num_bytes, field)
    if source == "cuda_ipc_handle":
        return gpu.open_ipc(region.handle.cuda_ipc_handle, offset, num_bytes, region.device_id, field)
    index = region.handle.cuda_vmm_fd_index
    if not 0 <= index < len(fds):
        raise InvalidArgumentError(f"{field}.handle.cuda_vmm_fd_index", f"index {index}, {len(fds)} fds were sent")
    return gpu.import_vmm(os.dup(fds[index]), offset, num_bytes, region.device_id, field)
