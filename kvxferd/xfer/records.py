"""What the read executor keeps of a read: its connection to a remote engine, the posted read, its result.

A :class:`RemoteEngine` is one connection (plan, prepared lists, boards,
same-host ranks); an :class:`InFlightRead` one posted request as
:class:`~kvxferd.xfer.reads.ReadExecutor` advances it; a :class:`ReadResult`
how it ended, a failure being data (:class:`ReadFailure`), not an exception.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kvxferd.plan.engine import EngineTransferPlan, PlannedRead, RankRead
from kvxferd.xfer.nixl.agent import TransferState
from kvxferd.xfer.nixl.checks import BoardProbe
from kvxferd.xfer.samehost.hostmaps import HostRank


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


class TransferFailure(NamedTuple):
    """Why a transfer ended in ERR: the read's error text and kind, and, when the device's context is
    lost (no same-host GPU rank may copy any more), the device's own words; else ''."""

    error: str
    kind: ReadFailure
    context_lost: str = ""


class TransferHandle(Protocol):
    """A rank's data transfer as the read executor holds it: a NIXL READ
    (:class:`kvxferd.xfer.nixl.transfers.NixlTransfer`) or a batch of device copies
    (:class:`kvxferd.xfer.samehost.devicemaps.PendingDeviceCopy`); the executor never asks which."""

    def state(self) -> TransferState:
        """DONE, PROC (still running) or ERR (then :meth:`failure` says why)."""

    def failure(self) -> TransferFailure:
        """Why it ended in ERR."""

    def running(self) -> bool:
        """Whether it may still write into the local blocks (an aborted READ UCX cannot stop)."""

    def release(self) -> None:
        """Let go of it (never raises)."""


@dataclass(frozen=True, eq=False)
class ReadResult:
    """How one request ended. A failure is data, not an exception."""

    request_id: str
    remote_engine_id: str
    ok: bool
    num_bytes: int
    num_descriptors: int  # posted, before NIXL merges contiguous neighbours
    duration_s: float
    invalid_block_ids: tuple[np.ndarray, ...]  # per group; empty when ok
    failed_ranks: tuple[int, ...] = ()
    error: str | None = None
    failure: ReadFailure = ReadFailure.NONE
    unsettled: bool = False  # aborted with a transfer still running past abort_drain_s: may still write


@dataclass(eq=False)
class RemoteEngine:
    """A connected remote engine: its plan, agent names and prepared lists."""

    plan: EngineTransferPlan
    agent_names: tuple[str, ...]  # per remote rank
    local_lists: dict[int, object]  # per read rank: prepared local descriptors
    remote_lists: dict[int, object]
    board_lists: dict[int, object] = field(default_factory=dict)  # per read rank: the holder's board, per bucket
    board_buckets: tuple[int, ...] = ()  # per remote rank; () when connected without boards (nothing checked)
    hold_keys: tuple[bytes, ...] = ()  # per remote rank, with the boards: every read's capabilities are checked
    probe: BoardProbe | None = None  # the connection's probe while it runs (start_probe)
    # Reads of this connection whose aborted transfers may still run: a re-handshake keeps it loaded
    # (ReadExecutor's retired list) until they ended, so none runs on after its lists and agents were released.
    num_draining: int = 0
    # Same-host reads (issue #37): remote rank -> its memory opened here, copied by this process instead of
    # a NIXL READ (host memory: in the kernel; GPU memory: a batch on the device); a rank whose memory could
    # not be opened reads over NIXL (why: host_errors).
    host_ranks: dict[int, HostRank] = field(default_factory=dict)
    host_errors: dict[int, str] = field(default_factory=dict)


@dataclass(eq=False)
class InFlightRead:
    """A posted request; advance it with :meth:`ReadExecutor.poll`."""

    planned: PlannedRead
    remote: RemoteEngine
    start_s: float
    handles: dict[int, TransferHandle] = field(default_factory=dict)  # rank -> its transfer, still running
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why it failed
    failure: ReadFailure = ReadFailure.NONE  # the first failure's kind
    result: ReadResult | None = None
    # Board checks, two per rank: before its data READ is posted (the rank's read waits in ``admitting``
    # meanwhile) and after it ended. Both look for the rank's hold tag.
    tags: dict[int, int] = field(default_factory=dict)  # rank -> its hold's board tag (empty: not checked)
    admitting: dict[int, RankRead] = field(default_factory=dict)  # rank -> its read, posted once the hold is seen
    unchecked: list[int] = field(default_factory=list)  # ranks waiting for a free check slot
    checks: dict[int, tuple[object, int]] = field(default_factory=dict)  # rank -> (check handle, slot)
    stale_ranks: set[int] = field(default_factory=set)  # checked: the hold had ended (before: nothing copied)
    # Ranks whose data READ or board check did not end within its post. Over shared memory UCX copies
    # inside the post and the holder does nothing; over TCP the READ waits for the holder's progress
    # (RDMA also ends later, without it: counted here too, the holder's safe side). The notice says so.
    waited_ranks: set[int] = field(default_factory=set)
    step: int = 0  # counts ranks whose data READ or check ended: a poller sees progress short of the end
    posted_s: float = 0.0  # perf_counter when every rank's first transfer (board check or data) was posted
    transferred_s: float = 0.0  # perf_counter when the last data READ ended
    notified: bool = False  # its notices went out (send_notices)
    num_host_copies: int = 0  # ranks whose data was copied same-host, not read over NIXL
    # Aborted transfers still in flight: UCX cannot stop a READ, its bytes land when they arrive. The
    # result waits for them (reads.py, abort) until ``drain_until_s``; past it, ``unsettled``.
    draining: dict[tuple[str, int], tuple[object, int | None]] = field(default_factory=dict)  # (what, rank) ->
    drain_until_s: float = 0.0  # (handle, check slot or None)
    drain_counted: bool = False  # counted in its remote's num_draining
    unsettled: bool = False

    def fail(self, q: int, error: str, failure: ReadFailure) -> None:
        self.errors.setdefault(q, error)
        if self.failure is ReadFailure.NONE:
            self.failure = failure
