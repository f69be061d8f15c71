"""A same-host holder's hold board, mapped read-only: a board check is two loads, not a NIXL READ.

A reader that copies a rank's blocks itself (:mod:`kvxferd.xfer.samehost.hostmaps`)
would still READ the holder's board over NIXL before and after each copy:
on one host, with a sandboxed reader worker, that READ takes UCX's slow
lanes and waits for the holder's progress. The holder names the memfd its
board lies in (:mod:`kvxferd.xfer.boardmemory`) to proven same-host readers;
the reader maps it read-only at connect, and the rank machine checks a hold
by looking at its two buckets::

    before the copy: tag in bucket b0 or b1?  no ─► stale, nothing copied
    copy (process_vm_readv: done when it returns; a device batch: when its event is)
    after the copy:  tag still there?          no ─► stale, the rank's blocks invalid

The holder removes a tag before it lets its blocks go, so a tag seen after
the copy ended means the blocks were held through it: the same argument as
a READ posted after the data READ ended. Two things a READ would have said
are checked here instead. A holder that exited leaves its board's pages
mapped here with every tag frozen (a READ of a dead agent fails): each check
reads the tag, then polls the holder's pidfd, and a gone holder fails the
check. And the board must be a memfd sealed against shrinking: these are
plain loads, and a page taken away under them would be SIGBUS, not EFAULT.
(Ordering: the loads follow the copy's syscall, or the device event that
ended it, in program order; this relies on the syscall boundary, as x86's
TSO gives and arm64's exception return is taken to give.)
"""

from __future__ import annotations

import ctypes
import os
import select

import numpy as np

from kvxferd.errors import TransferError
from kvxferd.plan.board import SLOTS_PER_BUCKET, BoardInfo, bucket_pair, check_num_buckets, tag_in
from kvxferd.plan.groups import HostShare
from kvxferd.xfer.handles import ReadFailure, TransferFailure
from kvxferd.xfer.nixl.agent import TransferState
from kvxferd.xfer.samehost.hostmaps import SHM_DIR, map_object
from kvxferd.xfer.samehost.opened import OpenedObjects, holder_pidfd


class MappedBoard:
    """One holder rank's board as mapped here, and its holder's pidfd. Not thread-safe: its executor's lock
    guards checks and close (a check after close raises instead of touching unmapped pages)."""

    def __init__(self, base: int, num_buckets: int, pidfd: int, closers: list) -> None:
        self.num_buckets = num_buckets
        # A view at the mapping's address (no export of the mmap, so close can unmap it: hence the flag).
        self._words = np.ctypeslib.as_array((ctypes.c_uint64 * (num_buckets * SLOTS_PER_BUCKET)).from_address(base))
        self._words = self._words.reshape(num_buckets, SLOTS_PER_BUCKET)
        self._holder = select.poll()
        self._holder.register(pidfd, select.POLLIN)
        self._closers = [*closers, lambda: os.close(pidfd)]
        self.closed = False

    def holds(self, tag: int) -> bool:
        """Whether ``tag`` is on the board now; raises :class:`TransferError` once unmapped, or when the holder
        exited (its board's tags say nothing any more)."""
        if self.closed:
            raise TransferError("same_host", "the holder's board was unmapped (its connection was released)")
        seen = tag_in(self._words[list(bucket_pair(tag, self.num_buckets))], tag)
        if self._holder.poll(0):  # after the load: the holder lived when the tag was read
            raise TransferError("same_host", "the holder's daemon exited: its board says nothing any more")
        return seen

    def close(self) -> None:
        self.closed = True
        self._words = None
        for closer in self._closers:
            closer()
        self._closers.clear()


def map_board(board: BoardInfo, opened: OpenedObjects | None = None, shm_dir: str = SHM_DIR) -> MappedBoard:
    """Map a holder's board read-only from the memfd it named by its own fd (checked like a region's object,
    and sealed against shrinking), with its holder's pidfd (``opened``'s, else opened here). Raises
    :class:`TransferError` (its checks stay NIXL READs)."""
    share = board.share
    if not isinstance(share, HostShare) or share.name:
        raise TransferError("same_host", "the holder named no memfd of its own for its board")
    num_bytes = check_num_buckets(board.num_buckets) * SLOTS_PER_BUCKET * 8
    pidfd = opened.pidfd(share.holder_pid) if opened is not None else None
    if pidfd is None:
        pidfd = holder_pidfd(share.holder_pid)
    closers: list = []
    try:
        base, size = map_object(share, shm_dir, closers, opened, sealed=True)
        if share.offset % 8 or share.offset + num_bytes > size:
            raise TransferError("same_host", f"a board of {num_bytes} bytes does not lie inside the {size} bytes "
                                             f"the holder named for it (offset {share.offset})")
        return MappedBoard(base + share.offset, board.num_buckets, pidfd, closers)
    except BaseException:
        os.close(pidfd)
        for closer in closers:
            closer()
        raise


class LoadedCheck:
    """A board check that ended where it was posted (a :class:`~kvxferd.xfer.handles.TransferHandle`):
    the hold was seen, or not, by looking at the mapped board."""

    __slots__ = ("seen",)
    lands_in_blocks = False

    def __init__(self, seen: bool) -> None:
        self.seen = seen

    def state(self) -> TransferState:
        return TransferState.DONE

    def failure(self) -> TransferFailure:
        return TransferFailure("board check: no failure", ReadFailure.TRANSFER)  # never ERR

    def running(self) -> bool:
        return False

    def found(self, tag: int) -> bool:
        return self.seen

    def release(self) -> None:
        pass
