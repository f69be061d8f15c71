"""Advance every rank of a posted transfer through its phases (:mod:`kvxferd.xfer.rankstate`).

::

    start      each rank with a tag waits for a check slot; the others' data is posted (mover)
    advance    checks that ended: hold seen -> post the rank's data; not seen -> stale
               data that ended: -> its second check (or DONE without boards); ERR -> failed
               checks again: over shared memory each ends inside its post, so a small
               transfer ends in one round
    abort      every rank not ended fails; one whose transfer or check still runs DRAINS
    settle     release what drained (everything, past the drain's deadline)

The machine knows board checks and handles (:class:`~kvxferd.xfer.handles.TransferHandle`),
never what moves the data: a :class:`Mover` posts a rank's bytes, as a NIXL
READ, a same-host copy, or (push) a WRITE.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from kvxferd.errors import TransferError
from kvxferd.plan.engine import RankRead
from kvxferd.xfer.handles import ReadFailure, TransferFailure, TransferHandle
from kvxferd.xfer.nixl.agent import NixlError, TransferState
from kvxferd.xfer.nixl.checks import CheckArea
from kvxferd.xfer.nixl.transfers import nixl_failure
from kvxferd.xfer.rankstate import RankPhase, RankTransfer
from kvxferd.xfer.records import Drain, InFlightRead, RemoteEngine
from kvxferd.xfer.samehost.boards import LoadedCheck

STALE_ERROR = ("stale read: the hold had ended (lease expired or released) before the read was checked "
               "against the holder's board")
UNHELD_ERROR = ("stale read, nothing copied: the holder's board shows no live hold sealed by this capability "
                "(it ended, or never was) before the read was posted")


class Posted(NamedTuple):
    """How posting a rank's data went: a handle to poll, or done inside the post (no handle), or failed."""

    handle: TransferHandle | None = None
    waited: bool = False  # it did not end within its post
    copied_here: bool = False  # copied by this process (same host), not moved over NIXL
    failure: TransferFailure | None = None  # nothing of it runs


class Mover(Protocol):
    """What moves a rank's data (the reads' is :class:`kvxferd.xfer.movers.ReadMover`)."""

    def move(self, remote: RemoteEngine, q: int, move: RankRead) -> Posted:
        """Post remote rank ``q``'s part (never raises: a failure is :attr:`Posted.failure`)."""

    def transfer_failed(self, failure: TransferFailure) -> None:
        """A posted transfer ended in ERR (a lost device context stops every same-host GPU copy)."""


class RankMachine:
    """Advances the ranks of transfers into one local cache; not thread-safe (its executor's lock is)."""

    def __init__(self, checks: CheckArea, mover: Mover) -> None:
        self.checks = checks
        self.mover = mover

    def start(self, inflight: InFlightRead) -> None:
        """Post what each rank can post now: its first check, or (no boards) its data."""
        for q, rank in inflight.ranks.items():
            if not rank.tag:  # nothing to check (connected without boards): its data at once
                self._move(inflight, q, rank)
        self._post_checks(inflight)
        inflight.times.posted_s = time.perf_counter()

    def advance(self, inflight: InFlightRead) -> bool:
        """One round over every rank; True once each has ended."""
        self._poll_checks(inflight)
        for q, rank, transfer, state in self._ended(inflight, (RankPhase.MOVING,)):
            if state is TransferState.ERR:
                failure = transfer.failure()
                inflight.fail(q, failure.error, failure.kind)
                self.mover.transfer_failed(failure)
            else:
                self._moved(rank)
            transfer.release()
        if not inflight.times.transferred_s and not inflight.data_pending:
            inflight.times.transferred_s = time.perf_counter()
        self._poll_checks(inflight)
        return all(rank.ended for rank in inflight.ranks.values())

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure, drain_s: float) -> None:
        """Fail every rank not ended; those with a transfer or check running drain (see :meth:`settle`)."""
        for q, rank in inflight.ranks.items():
            if not rank.ended and rank.phase is not RankPhase.DRAINING:
                inflight.fail(q, reason, failure)
        if inflight.drain is None:
            inflight.drain = Drain(time.perf_counter() + drain_s)

    def settle(self, inflight: InFlightRead, *, force: bool = False) -> bool:
        """Release each drained transfer that ended (all of them past the drain's deadline, or ``force``d);
        True when none is left. One that still ran when given up may write its blocks: ``unsettled``."""
        drain = inflight.drain
        past = force or time.perf_counter() >= drain.until_s
        left = False
        for rank in inflight.ranks.values():
            if rank.phase is not RankPhase.DRAINING:
                continue
            running = rank.handle.running()
            if running and not past:
                left = True
                continue
            handle = rank.drained()
            drain.unsettled |= running and not force and handle.lands_in_blocks
            handle.release()  # a board check still running: its slot waits in quarantine (checks.py)
        return not left

    # ---- internals ---------------------------------------------------------
    @staticmethod
    def _ended(inflight: InFlightRead, phases: tuple[RankPhase, ...]):
        """Each rank in ``phases`` whose transfer or check ended, as (rank id, rank, its handle, its
        state); the rank holds no handle after (the caller releases it)."""
        for q, rank in inflight.ranks.items():
            if rank.handle is None or rank.phase not in phases:
                continue
            state = rank.handle.state()
            if state is TransferState.PROC:
                continue
            inflight.step += 1
            yield q, rank, rank.take_handle(), state

    def _move(self, inflight: InFlightRead, q: int, rank: RankTransfer) -> None:
        posted = self.mover.move(inflight.remote, q, rank.move)
        if posted.failure is not None:
            inflight.fail(q, posted.failure.error, posted.failure.kind)
            return
        rank.copied_here |= posted.copied_here
        rank.enter(RankPhase.MOVING, posted.handle, waited=posted.waited)
        if posted.handle is None:  # in already (copied inside the post)
            inflight.step += 1
            self._moved(rank)

    @staticmethod
    def _moved(rank: RankTransfer) -> None:
        """The rank's data is in: now ask the board whether it was still held (without boards: done)."""
        rank.enter(RankPhase.RECHECKING if rank.tag else RankPhase.DONE)

    def _post_checks(self, inflight: InFlightRead) -> None:
        """Post the board checks of ranks waiting for one, while check slots are free."""
        remote = inflight.remote
        for q, rank in inflight.ranks.items():
            if not rank.needs_check:
                continue
            host_rank = remote.host_ranks.get(q)
            if host_rank is not None and host_rank.board is not None:  # same host: look at the mapped board
                self._check_mapped(inflight, q, rank, host_rank.board)
                continue
            try:
                posted = self.checks.post(remote.board_lists[q], remote.board_buckets[q], rank.tag, remote)
            except NixlError as err:
                inflight.fail(q, f"board check: {err}", nixl_failure(err))
                continue
            if posted is None:
                return  # every slot taken: the next round tries again
            check, state = posted
            if state is TransferState.ERR:
                check.release()
                inflight.fail(q, "board check: posting reported an error", ReadFailure.TRANSFER)
                continue
            rank.enter(RankPhase.CHECKING if rank.phase is RankPhase.ADMITTING else RankPhase.RECHECKING, check,
                       waited=state is TransferState.PROC)

    @staticmethod
    def _check_mapped(inflight: InFlightRead, q: int, rank, board) -> None:
        """A check on a same-host holder's board mapped here: it ends within its post (settled by
        :meth:`_poll_checks` like a READ that ended at once)."""
        try:
            seen = board.holds(rank.tag)
        except TransferError as err:
            inflight.fail(q, f"board check: {err.message}", ReadFailure.TRANSFER)
            return
        rank.enter(RankPhase.CHECKING if rank.phase is RankPhase.ADMITTING else RankPhase.RECHECKING,
                   LoadedCheck(seen), waited=False)

    def _poll_checks(self, inflight: InFlightRead) -> None:
        """Post waiting checks, then settle the ended ones: a rank seen held before its data posts it; a
        rank whose hold is gone is stale (before its data: nothing of it was copied)."""
        self._post_checks(inflight)
        for q, rank, check, state in self._ended(inflight, (RankPhase.CHECKING, RankPhase.RECHECKING)):
            if state is TransferState.ERR:
                inflight.fail(q, check.failure().error, check.failure().kind)
            elif not check.found(rank.tag):
                inflight.fail(q, UNHELD_ERROR if rank.phase is RankPhase.CHECKING else STALE_ERROR, ReadFailure.STALE)
            elif rank.phase is RankPhase.CHECKING:
                self._move(inflight, q, rank)
            else:
                rank.enter(RankPhase.DONE)
            check.release()
