"""Which remote ranks a reader copies itself (issue #37), opened at connect and dropped back to NIXL.

A remote engine's connection keeps, per remote rank, either a
:class:`~kvxferd.xfer.samehost.hostmaps.HostRank` (its memory opened here: host
memory mapped, GPU memory opened from IPC handles) or the reason it reads
over NIXL (``host_errors``). A rank goes back to NIXL when its holder changed
or went away, when the driver refuses a batch, or, for every GPU rank, when
a device fault poisoned the context.
"""

from __future__ import annotations

import os

from kvxferd.cuda.copies import BatchCopier
from kvxferd.errors import KvxferError, TransferError
from kvxferd.plan.board import BoardInfo
from kvxferd.plan.engine import RankPlan
from kvxferd.plan.groups import EngineCache, HostShare
from kvxferd.xfer.samehost.boards import map_board
from kvxferd.xfer.samehost.devicemaps import device_rank, map_device_source
from kvxferd.xfer.samehost.hostmaps import HostRank, MappedSource, map_host_source
from kvxferd.xfer.samehost.opened import OpenedObjects


class SameHostOpener:
    """Opens same-host remote ranks' memory for copies into one local cache; owns the GPU copier."""

    def __init__(self, cache: EngineCache) -> None:
        self.cache = cache
        self.device_copier: BatchCopier | None = None  # made at the first GPU connection

    def open(self, remote: EngineCache, rank_plan: RankPlan, opened: OpenedObjects | None = None,
             board: BoardInfo | None = None) -> tuple[HostRank, str]:
        """A remote rank's memory, opened for copies (same kind of memory as the local cache), and its
        ``board`` mapped when the holder named its memory: the rank, and why its board is not mapped ("": it
        is; else its checks stay NIXL READs). Raises :class:`TransferError` saying why the rank is read over
        NIXL instead. ``opened``: see :func:`~kvxferd.xfer.samehost.hostmaps.map_host_source`."""
        rank = self._open(remote, rank_plan, opened)
        try:
            rank.board, board_error = board_with(rank.source, board, "holder", opened)
        except BaseException:
            rank.source.close()
            raise
        return rank, board_error

    def _open(self, remote: EngineCache, rank_plan: RankPlan, opened: OpenedObjects | None) -> HostRank:
        if remote.mem_type != self.cache.mem_type:
            raise TransferError("same_host", f"{remote.mem_type} memory is read into {self.cache.mem_type} over NIXL")
        if self.cache.mem_type == "DRAM":
            return HostRank.of(map_host_source(remote, opened=opened), rank_plan)
        if self.device_copier is None:
            try:
                self.device_copier = BatchCopier(self.cache.memory[0][0].device_id)
            except KvxferError as err:  # no usable driver call: every GPU read goes over NIXL
                raise TransferError("same_host", f"no device copies here: {err.message}") from None
        if self.device_copier.broken:
            raise TransferError("same_host", f"no device copies any more: {self.device_copier.broken}")
        return device_rank(map_device_source(remote, self.device_copier, opened=opened), rank_plan,
                           self.device_copier)

    def close(self) -> None:
        if self.device_copier is not None:
            self.device_copier.close()


def open_push_target(writer: EngineCache, target: EngineCache, copy_plans, board: BoardInfo | None
                     ) -> tuple[MappedSource, list[HostRank], str]:
    """A push target rank's host memory mapped read-write here, once, with one :class:`HostRank` (``writes``)
    per plan in ``copy_plans`` (:attr:`kvxferd.plan.push.PushPlan.copy_plan`: the whole write's, and its plan by
    layer where that differs), and its ``board`` mapped read-only when the target named it: the mapping (closed
    with the connection), the ranks, and why the board is not mapped ("": it is; else checked over NIXL).
    Raises :class:`TransferError` saying why the target is written over NIXL instead.

    Host memory only: a GPU target is written over NIXL (UCX's cuda_ipc lane on one host)."""
    if (writer.mem_type, target.mem_type) != ("DRAM", "DRAM"):
        raise TransferError("same_host", f"{writer.mem_type} memory is written into {target.mem_type} over NIXL "
                                         "(a push copies host memory only)")
    refuse_own_memory(writer, target)
    source = map_host_source(target, writable=True)
    try:
        ranks = [HostRank.of(source, plan, writes=True) for plan in copy_plans]
        mapped_board, board_error = board_with(source, board, "target")
    except BaseException:
        source.close()
        raise
    for rank in ranks:
        rank.board = mapped_board
    return source, ranks, board_error


def board_with(source: MappedSource, board: BoardInfo | None, whose: str, opened: OpenedObjects | None = None):
    """A peer rank's ``board`` mapped read-only beside its memory ``source`` (unmapped with it), when the peer
    (``whose``: "holder" or "target") named the memory it lies in: the mapped board, or None and why not
    (its checks then stay NIXL READs)."""
    if board is None or board.share is None:
        return None, f"the {whose} named no memory for its board"
    try:
        mapped = map_board(board, opened)
    except TransferError as err:
        return None, err.message
    source.closers.append(mapped.close)
    return mapped, ""


def refuse_own_memory(writer: EngineCache, target: EngineCache) -> None:
    """A target's regions may not lie in memory this process holds open (an engine's passed fd, its boards'
    memfds: named as ``/proc/<this pid>/fd/<n>``) or in the writer engine's own objects: a peer that proved
    this host could otherwise get the writer to map and overwrite them (its board is only read). Raises
    :class:`TransferError` (written over NIXL: into the target's registered memory only)."""
    own = {(r.share.device, r.share.inode) for regions in writer.memory for r in regions
           if isinstance(r.share, HostShare)}
    for share in (r.share for regions in target.memory for r in regions if isinstance(r.share, HostShare)):
        if share.holder_pid == os.getpid() or (share.device, share.inode) in own:
            raise TransferError("same_host", "the target names memory of the writer itself")


def drop_rank(remote, q: int, reason: str) -> None:
    """Read remote rank ``q`` of ``remote`` (a connection) over NIXL from now on: close its memory here."""
    host_rank = remote.host_ranks.pop(q, None)
    remote.board_errors.pop(q, None)  # (its board goes with it: checked over NIXL, as every NIXL rank)
    if host_rank is not None:
        host_rank.source.close()
        remote.host_errors[q] = reason


def drop_all(remote, reason: str, *, on_device_only: bool = False) -> None:
    """Every same-host rank of ``remote`` (or only its GPU ones) over NIXL from now on."""
    for q in [q for q, rank in remote.host_ranks.items() if rank.on_device or not on_device_only]:
        drop_rank(remote, q, reason)
