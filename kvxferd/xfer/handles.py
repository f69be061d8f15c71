"""What a transfer is to the executor, whatever moves it: a handle with a state, and a failure as data.

A rank's data moves as a NIXL READ (:class:`kvxferd.xfer.nixl.transfers.NixlTransfer`)
or a batch of device copies (:class:`kvxferd.xfer.samehost.devicemaps.PendingDeviceCopy`);
its hold is checked with a small NIXL READ of the holder's board
(:class:`kvxferd.xfer.nixl.checks.BoardCheck`). The executor polls, fails,
drains and releases all three the same way and never asks which::

    posted ──► state(): PROC ... ──► DONE ──────────────► release()
                                └──► ERR ──► failure() ──► release()
    aborted ──► running()? (an abandoned READ may still write) ──► release()
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

from kvxferd.xfer.nixl.agent import TransferState


class ReadFailure(str, enum.Enum):
    """Why a read failed, set where it happens (a bounded metrics label, never parsed from a message)."""

    NONE = ""
    TRANSFER = "transfer"  # NIXL reported an error for a rank
    REMOTE_GONE = "remote_gone"  # the remote agent disconnected or is unknown
    DEADLINE = "deadline"  # the transfer or the board check did not end in time
    STALE = "stale"  # the hold's tag was not (or no longer) on the holder's board when the read was checked
    ABORTED = "aborted"  # the engine or the link went away under the read
    HANDSHAKE = "handshake"  # a re-handshake before posting failed
    REFUSED = "refused"  # refused before anything was posted (Reads stream)
    CORRUPT = "corrupt"  # the blocks written differ from the holder's digests of its hold (issue #59)


class TransferFailure(NamedTuple):
    """Why a transfer ended in ERR: the read's error text and kind, and, when the device's context is
    lost (no same-host GPU rank may copy any more), the device's own words; else ''."""

    error: str
    kind: ReadFailure
    context_lost: str = ""


class TransferHandle(Protocol):
    """A posted transfer of one rank: its data, or a check of its hold."""

    # True when its bytes land in the engine's blocks (a rank's data), False when they land in
    # the reader's own check area (a board check): only the former can leave a read unsettled.
    lands_in_blocks: bool

    def state(self) -> TransferState:
        """DONE, PROC (still running) or ERR (then :meth:`failure` says why)."""

    def failure(self) -> TransferFailure:
        """Why it ended in ERR."""

    def running(self) -> bool:
        """Whether it may still write (an aborted READ UCX cannot stop)."""

    def release(self) -> None:
        """Let go of it (never raises)."""
