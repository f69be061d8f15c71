"""Open GPU memory an engine shares: CUDA IPC handles and CUDA VMM fds.

Both go through the CUDA libraries with ``ctypes`` (no CUDA build of torch
needed in the daemon):

* IPC: the 64-byte ``cudaIpcMemHandle_t`` of the engine's allocation (what
  ``torch`` produces when it shares a CUDA storage) is opened with
  ``cudaIpcOpenMemHandle``; the region starts ``offset`` bytes in.
* VMM: a POSIX fd exported with ``cuMemExportToShareableHandle`` arrives
  over the fd socket (see :mod:`kvxferd.service.engines.fdpass`), is imported with
  ``cuMemImportFromShareableHandle`` and mapped into a reserved range.

Without a CUDA driver both raise :class:`UnavailableError` naming the field;
``tests/gpu/`` exercises them on a machine with a GPU.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, replace

from kvxferd.cuda.driver import VMM_GRANULARITY
from kvxferd.cuda.ipc import bare_ipc_handle, open_ipc_allocation, visible_device_uuids
from kvxferd.cuda.vmm import LEGACY_IPC, import_allocation
from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.plan.groups import DeviceShare, RegionMemory, VmmShare


@dataclass(eq=False)
class GpuMapping:
    """An opened GPU region; ``close`` after NIXL deregistered it. ``kind``: what can serve it
    (:data:`kvxferd.cuda.vmm.MEMORY_KINDS`: RDMA-capable VMM memory, VMM memory a NIC cannot read, or
    legacy IPC memory, which neither a NIC nor UCX's cuda_ipc lane can serve from this process)."""

    memory: RegionMemory
    _close: object
    kind: str = LEGACY_IPC
    allocation_bytes: int = 0  # a VMM import: the whole allocation mapped (the region is a part of it)
    offset: int = 0  # of the region in it

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def open_ipc(handle: bytes, offset: int, num_bytes: int, device_id: int, field: str, device_uuid: str = "",
             *, uuids=visible_device_uuids) -> GpuMapping:
    """Open a CUDA IPC handle; the region is ``[offset, offset + num_bytes)`` of the allocation.

    The region remembers the handle and its GPU's UUID (:class:`DeviceShare`):
    what a proven same-host reader opens itself (issue #37). Without a UUID
    from the engine, the one this daemon sees at ``device_id``.
    """
    handle = bare_ipc_handle(handle, field)
    if offset < 0 or num_bytes <= 0 or device_id < 0:
        raise InvalidArgumentError(field, f"bad range or device: offset {offset}, {num_bytes} bytes, device {device_id}")
    allocation = open_ipc_allocation(handle, device_id, field)
    try:  # the region must lie inside the shared allocation: never expose the memory around it
        if offset + num_bytes > allocation.num_bytes:
            raise InvalidArgumentError(f"{field}.num_bytes", f"region [{offset}, {offset + num_bytes}) exceeds the "
                                                             f"shared allocation of {allocation.num_bytes} bytes")
        device_uuid = device_uuid or uuid_of(device_id, field, uuids)
        share = DeviceShare(handle, offset, device_uuid) if device_uuid else None
    except BaseException:
        allocation.close()
        raise
    return GpuMapping(RegionMemory(allocation.base + offset, num_bytes, device_id, share=share), allocation.close)


def uuid_of(device_id: int, field: str, uuids=visible_device_uuids) -> str:
    """The UUID of this daemon's GPU ``device_id`` ("" when it cannot be told: no same-host reads of it)."""
    try:
        seen = uuids(f"{field}.device_id")
    except (UnavailableError, InvalidArgumentError):
        return ""
    return seen[device_id] if device_id < len(seen) else ""


def import_vmm(fd: int, offset: int, num_bytes: int, device_id: int, field: str, *,
               allocation_bytes: int = 0, rdma_capable: bool = False, lib=None) -> GpuMapping:
    """Import a VMM shareable fd and map all of it read-write on ``device_id``; always closes ``fd``.

    CUDA maps whole allocations only, so the engine names the allocation's
    size (``allocation_bytes``; 0: the region ends where it does); the
    driver refuses a size that is not the allocation's, and the region must
    lie inside it. ``rdma_capable``: the engine's word that it made the allocation with
    gpuDirectRDMACapable. The driver shows an importer zeroed flags (measured on an H200, driver 580), so
    the word decides the mapping's kind; a false one only turns the engine's own refusal under
    ``require_rdma_capable_vram`` into a NIC registration that fails (no other engine's memory is involved).
    """
    try:
        return _import_vmm(fd, offset, num_bytes, device_id, field, allocation_bytes, rdma_capable, lib)
    finally:
        os.close(fd)  # an imported handle keeps the allocation alive without the fd


def _import_vmm(fd: int, offset: int, num_bytes: int, device_id: int, field: str, allocation_bytes: int,
                rdma_capable: bool, lib) -> GpuMapping:
    if offset < 0 or num_bytes <= 0 or device_id < 0:
        raise InvalidArgumentError(field, f"bad range or device: offset {offset}, {num_bytes} bytes, device {device_id}")
    if allocation_bytes and offset + num_bytes > allocation_bytes:
        raise InvalidArgumentError(f"{field}.num_bytes", f"region [{offset}, {offset + num_bytes}) exceeds the shared "
                                                         f"allocation of {allocation_bytes} bytes")
    f = f"{field}.handle.cuda_vmm_fd_index"
    size = allocation_bytes or -(-(offset + num_bytes) // VMM_GRANULARITY) * VMM_GRANULARITY
    allocation = import_allocation(fd, size, device_id, f, lib)
    kind = "rdma_capable" if rdma_capable or allocation.capabilities.rdma_capable else allocation.capabilities.kind
    return GpuMapping(RegionMemory(allocation.base + offset, num_bytes, device_id), allocation.close, kind, size, offset)


class VmmOffers:
    """One registration's VMM allocations offered to same-host readers (issue #56): one token per allocation
    (the engine's fd index), however many regions lie in it, served by the fd socket ``inbox`` while any of
    those regions' mappings lives, and withdrawn (its fd closed) with the last."""

    MAX_SOCKET_BYTES = 1024  # what a reader takes (wire/messages.py: SHARE_SOCKET_MAX_BYTES)

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.offered: dict[int, list] = {}  # fd index -> [token, fd, mappings alive]

    def share(self, mapping: GpuMapping, index: int, fd_source, device_uuid: str) -> None:
        """Name ``mapping``'s allocation in its region's :class:`VmmShare` (``fd_source()``: a copy of the
        engine's fd, taken only the first time), and withdraw it when the mapping closes."""
        if len(self.inbox.path.encode()) > self.MAX_SOCKET_BYTES:
            return  # a path readers refuse: they read it over NIXL
        if index not in self.offered:
            token, fd = secrets.token_hex(16), fd_source()
            self.inbox.offer(token, fd)
            self.offered[index] = [token, fd, 0]
        entry = self.offered[index]
        entry[2] += 1
        mapping.memory = replace(mapping.memory, share=VmmShare(entry[0], self.inbox.path, os.getpid(),
                                                                mapping.offset, mapping.allocation_bytes, device_uuid))
        close = mapping._close

        def release_then_close() -> None:
            entry[2] -= 1
            if entry[2] == 0:
                self.inbox.withdraw(entry[0])
                os.close(entry[1])
                self.offered.pop(index, None)
            close()

        mapping._close = release_then_close


def check_servable(mapping: GpuMapping, require_rdma: bool, field: str) -> str:
    """What a NIC can make of a VRAM region: "" when it can read it, else the warning to log (or, with
    ``require_rdma`` / ``require_rdma_capable_vram``, :class:`UnavailableError`: FAILED_PRECONDITION).

    Memory a NIC cannot register is read from other hosts by UCX's software
    emulation over TCP (under 1 GB/s); same-host readers copy it with the
    span-copy kernel either way.
    """
    if mapping.kind == "rdma_capable":
        return ""
    how = ("shared by a CUDA IPC handle (cudaMalloc memory): neither a NIC nor UCX's cuda_ipc lane can serve it "
           "from the daemon" if mapping.kind == LEGACY_IPC else
           "a VMM allocation made without gpuDirectRDMACapable: a NIC cannot register it")
    message = (f"VRAM region {how}; reads from other hosts would be emulated over TCP (< 1 GB/s). Allocate the "
               "KV cache as RDMA-capable shareable VMM memory (the vLLM connector's KV-cache pool; docs/gpu.md)")
    if require_rdma:
        raise UnavailableError(f"{field}.handle", message)
    return message
