"""One remote rank's part of a transfer: a phase that only moves forward, and what that phase holds.

::

    ADMITTING ─slot─► CHECKING ─hold seen─► MOVING ─data in─► RECHECKING ─hold still seen─► DONE
        │                │ not seen: stale    │ ERR               │ not seen: stale
        └────────────────┴────────────────────┴───────────────────┴──────────────────────► FAILED
    aborted while its transfer or check runs ──► DRAINING ──it ended, or the drain gave up──► FAILED

A rank waits in ADMITTING (and in RECHECKING, without a handle) for a free
slot of the reader's check area. Without boards (benchmarks of the data path
alone) a rank goes straight to MOVING and its data in is DONE. A rank copied same-host
in the kernel ends MOVING inside its post. Nothing here names a direction:
a write (push) moves the same way, with another mover
(:class:`kvxferd.xfer.rankmachine.Mover`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvxferd.plan.engine import RankRead
from kvxferd.xfer.handles import ReadFailure, TransferHandle


class RankPhase(enum.IntEnum):
    """Where a rank is; its value only grows (:meth:`RankTransfer.enter`)."""

    ADMITTING = 0  # its hold must be seen on the holder's board before a byte of it moves
    CHECKING = 1  # that board check runs
    MOVING = 2  # its data transfer runs
    RECHECKING = 3  # the data is in: is the hold still on the board?
    DRAINING = 4  # failed while a transfer or check of it ran that cannot be stopped: waits for it
    DONE = 5
    FAILED = 6


@dataclass(eq=False, slots=True)
class RankTransfer:
    """A remote rank's part of one transfer, as the rank machine advances it."""

    move: RankRead  # the ids it moves, on each side
    tag: int  # its hold's board tag; 0: nothing is checked (connected without boards)
    phase: RankPhase = RankPhase.ADMITTING
    handle: TransferHandle | None = None  # its data transfer or board check while one runs
    error: str = ""  # why it failed (the first reason)
    failure: ReadFailure = ReadFailure.NONE
    # A transfer or check of it did not end within its post. Over shared memory UCX copies inside the
    # post and the holder does nothing; over TCP the READ waits for the holder's progress (RDMA ends
    # later too, without it: counted here, the holder's safe side). Its notice says so.
    waited: bool = False
    copied_here: bool = False  # its data was copied same-host, not moved over NIXL

    @property
    def ended(self) -> bool:
        return self.phase >= RankPhase.DONE

    @property
    def needs_check(self) -> bool:
        """Waiting for a check slot: before its data moves, or after it came in."""
        return self.handle is None and self.phase in (RankPhase.ADMITTING, RankPhase.RECHECKING)

    def enter(self, phase: RankPhase, handle: TransferHandle | None = None, *, waited: bool = False) -> None:
        """Move on to ``phase`` (never back), holding ``handle`` there."""
        if phase < self.phase or (phase == self.phase and phase is not RankPhase.RECHECKING):
            raise RuntimeError(f"rank phase {self.phase.name} cannot go to {phase.name}")
        self.phase, self.handle = phase, handle
        self.waited |= waited

    def take_handle(self) -> TransferHandle:
        """The handle of a transfer or check that ended (the rank holds none after)."""
        handle, self.handle = self.handle, None
        return handle

    def fail(self, error: str, failure: ReadFailure) -> None:
        """Failed (the first reason stays): DRAINING while it still holds a handle, else FAILED."""
        if self.ended or self.phase is RankPhase.DRAINING:
            return
        self.error, self.failure = error, failure
        self.phase = RankPhase.FAILED if self.handle is None else RankPhase.DRAINING

    def drained(self) -> TransferHandle:
        """DRAINING is over: FAILED, and the handle it waited for, to release."""
        self.phase = RankPhase.FAILED
        return self.take_handle()
