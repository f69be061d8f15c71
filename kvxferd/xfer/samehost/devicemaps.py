"""A same-host holder's GPU memory, opened by the reader from its CUDA IPC handles, read by batched copies.

Issue #37, the GPU half. Over NIXL a daemon's GPU reads run at UCX's
emulated speed on one host (its cuda_ipc cannot hand out memory the daemon
itself imported). When the holder proved the reader shares its host
(:mod:`kvxferd.wire.samehost`), it names the CUDA IPC handle of the
allocation each region lies in and the GPU's UUID (:class:`DeviceShare`).
The reader opens each allocation once per connection, on its own GPU (CUDA
maps the holder's memory into the reader's context and enables peer access
when it lies on another GPU; the UUID only names it in messages), checks
that a few bytes of it copy, and a rank's data READ becomes one batch of
device copies on the reader's stream::

    holder's address space        reader's address space
    region r at A_r ── handle h, offset o_r ──► allocation h opened at B (peer access if another GPU)
    remote span at a              ──────────► a - A_r + B + o_r   (checked: inside region r)
    one read: one span-copy launch (local spans <- translated spans) + an event, polled like a NIXL READ

The board checks before and after, the notices and the deadline stay as
over NIXL. Opening a handle gives the reader the whole allocation, not only
the region: only authenticated same-host readers get handles (docs/security.md).
"""

from __future__ import annotations

import numpy as np

from kvxferd.cuda.copies import BatchCopier, CopyEvent
from kvxferd.cuda.ipc import IpcAllocation, bare_ipc_handle, open_ipc_allocation
from kvxferd.errors import KvxferError, TransferError
from kvxferd.plan.engine import RankPlan
from kvxferd.plan.groups import DeviceShare, EngineCache, VmmShare
from kvxferd.xfer.nixl.agent import TransferState
from kvxferd.xfer.samehost.hostmaps import HostRank, MappedSource, empty_source
from kvxferd.xfer.samehost.opened import OpenedObjects
from kvxferd.xfer.samehost.vmmshare import open_vmm_share
from kvxferd.xfer.handles import ReadFailure, TransferFailure


class PendingDeviceCopy:
    """One rank's batch of device copies, in a read's handles beside NIXL transfers (a
    :class:`kvxferd.xfer.handles.TransferHandle`): polled for its state."""

    lands_in_blocks = True

    def __init__(self, event: CopyEvent) -> None:
        self.event = event
        self.error = ""  # why the device failed it (once its state is ERR)

    def state(self) -> TransferState:
        try:
            return TransferState.DONE if self.event.done() else TransferState.PROC
        except TransferError as err:
            self.error = err.message
            return TransferState.ERR

    def failure(self) -> TransferFailure:
        # A fault on the device poisons its context: no same-host GPU rank copies any more.
        return TransferFailure("same-host copy: the device reported an error", ReadFailure.TRANSFER, self.error)

    def running(self) -> bool:
        return False  # release() waits for the batch: nothing writes after it

    def release(self) -> None:
        self.event.release()


def map_device_source(cache: EngineCache, copier: BatchCopier, *, open_allocation=None,
                      open_vmm=None, opened: OpenedObjects | None = None) -> MappedSource:
    """Open every allocation a remote rank's GPU regions lie in, once each, on the copier's GPU, and copy a
    few bytes of each: by CUDA IPC handle (:class:`DeviceShare`), or as a VMM allocation's fd the holder
    serves (:class:`VmmShare`, issue #56). Raises :class:`TransferError` when a region has neither, a
    handle does not open (another PID namespace, a freed allocation), a region does not fit, or the check
    copy fails. ``opened``: the VMM fds fetched before (off the data-plane thread); one it lacks is fetched
    here."""
    open_allocation, open_vmm = open_allocation or open_ipc_allocation, open_vmm or open_vmm_share
    regions = [region for memory in cache.memory for region in memory]
    if cache.mem_type != "VRAM" or not regions or any(not isinstance(r.share, (DeviceShare, VmmShare))
                                                      for r in regions):
        raise TransferError("same_host", "not every region is GPU memory with a CUDA IPC handle or a VMM share")
    # Close in this order: wait for the copies already on the stream, then the allocations they read.
    source = empty_source()
    source.closers.append(copier.synchronize)
    allocations: dict[bytes | str, IpcAllocation] = {}
    try:
        for share in (region.share for region in regions):
            if _key(share) not in allocations:  # regions of one allocation share it
                allocation = (_open(share, copier.device_id, open_allocation) if isinstance(share, DeviceShare)
                              else _open_vmm(share, copier.device_id, open_vmm, opened))
                allocations[_key(share)] = allocation
                source.closers.append(allocation.close)
                _check(copier, allocation, share)
        source.place([(region, allocations[_key(region.share)].base + region.share.offset,
                       allocations[_key(region.share)].num_bytes - region.share.offset) for region in regions])
    except BaseException:
        source.close()
        raise
    return source


def _key(share: DeviceShare | VmmShare) -> bytes | str:
    return share.ipc_handle if isinstance(share, DeviceShare) else share.token


def _open_vmm(share: VmmShare, device_id: int, open_vmm, opened: OpenedObjects | None):
    fd = opened.vmm_fd(share.token) if opened is not None else None
    if fd is None:
        return open_vmm(share, device_id)
    return open_vmm(share, device_id, fetch=lambda _share: fd)  # (open_vmm_share closes it)


def _open(share: DeviceShare, device_id: int, open_allocation) -> IpcAllocation:
    try:
        return open_allocation(bare_ipc_handle(share.ipc_handle, "same_host"), device_id, "same_host")
    except KvxferError as err:  # another PID namespace, a handle of a freed allocation, no peer access
        raise TransferError("same_host", f"cannot open the holder's GPU memory (on {share.device_uuid}) on GPU "
                                         f"{device_id}: {err.message}") from None


def _check(copier: BatchCopier, allocation, share: DeviceShare | VmmShare) -> None:
    try:
        copier.check_source(allocation.base, allocation.num_bytes)
    except TransferError as err:
        raise TransferError("same_host", f"copying from the holder's GPU memory (on {share.device_uuid}) fails: "
                                         f"{err.message}") from None


def device_rank(source: MappedSource, rank_plan: RankPlan, copier: BatchCopier) -> HostRank:
    """How one remote rank's reads are copied on the device: its opened memory and the plan's tables."""
    def submit(destinations: np.ndarray, sources: np.ndarray, lengths: np.ndarray) -> PendingDeviceCopy:
        return PendingDeviceCopy(copier.submit(destinations, sources, lengths))

    return HostRank.of(source, rank_plan, copier=submit, on_device=True)
