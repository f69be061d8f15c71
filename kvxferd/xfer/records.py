"""What the read executor keeps of a read: its connection to a remote engine, the posted read, its result.

A :class:`RemoteEngine` is one connection (plan, prepared lists, boards,
same-host ranks); an :class:`InFlightRead` one posted request as
:class:`~kvxferd.xfer.reads.ReadExecutor` advances it; a :class:`ReadResult`
how it ended, a failure being data (:class:`ReadFailure`), not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvxferd.plan.engine import EngineTransferPlan, PlannedRead, ReadRequest
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.checks import BoardProbe
from kvxferd.xfer.rankstate import RankPhase, RankTransfer
from kvxferd.xfer.samehost.hostmaps import HostRank


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
    # Same-host ranks whose hold board is not mapped here, and why: their checks are NIXL READs of it.
    board_errors: dict[int, str] = field(default_factory=dict)


class AdmittedRead(NamedTuple):
    """A request whose capabilities were checked against one connection's hold keys, and its plan on it
    (None until planned). Made only by :func:`kvxferd.xfer.admission.admit`."""

    remote: RemoteEngine
    request: ReadRequest
    planned: PlannedRead | None


@dataclass(slots=True)
class ReadTimes:
    """A posted read's instants (``time.perf_counter``)."""

    start_s: float  # when it arrived (or was posted)
    posted_s: float = 0.0  # every rank's first transfer (board check or data) posted
    transferred_s: float = 0.0  # the last rank's data in


@dataclass(slots=True)
class Drain:
    """An aborted read waiting for transfers UCX cannot stop (their bytes land when they arrive)."""

    until_s: float  # past it, the result says its blocks may still be written
    unsettled: bool = False  # a data transfer still ran when the drain gave up
    counted: bool = False  # counted in its connection's num_draining


@dataclass(eq=False)
class InFlightRead:
    """A posted request: one :class:`RankTransfer` per remote rank it reads; advance it with
    :meth:`ReadExecutor.poll <kvxferd.xfer.reads.ReadExecutor.poll>`."""

    admitted: AdmittedRead  # planned on the connection it was posted on
    ranks: dict[int, RankTransfer]  # remote rank -> its part
    times: ReadTimes
    failure: ReadFailure = ReadFailure.NONE  # the first failure's kind
    result: ReadResult | None = None
    notified: bool = False  # its notices went out (send_notices)
    drain: Drain | None = None  # aborted (abort): its transfers may still write
    step: int = 0  # counts ranks whose transfer or check ended: a poller sees progress short of the end

    @property
    def remote(self) -> RemoteEngine:
        return self.admitted.remote

    @property
    def planned(self) -> PlannedRead:
        return self.admitted.planned

    @property
    def posted_s(self) -> float:
        return self.times.posted_s

    @property
    def transferred_s(self) -> float:
        return self.times.transferred_s

    @property
    def data_pending(self) -> bool:
        """Some rank's data is not in yet (on its way, or waiting for its first check)."""
        return any(r.phase < RankPhase.RECHECKING for r in self.ranks.values())

    @property
    def data_in_flight(self) -> bool:
        """Some rank's data transfer runs."""
        return any(r.phase is RankPhase.MOVING for r in self.ranks.values())

    @property
    def num_host_copies(self) -> int:
        """Ranks whose data was copied same-host, not read over NIXL."""
        return sum(r.copied_here for r in self.ranks.values())

    @property
    def errors(self) -> dict[int, str]:
        """Each failed rank's reason."""
        return {q: r.error for q, r in self.ranks.items() if r.phase in (RankPhase.DRAINING, RankPhase.FAILED)}

    def fail(self, q: int, error: str, failure: ReadFailure) -> None:
        self.ranks[q].fail(error, failure)
        if self.failure is ReadFailure.NONE:
            self.failure = failure
