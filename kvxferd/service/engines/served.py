"""An engine rank whose memory a data-plane worker serves to peers (issue #55, docs/dataplane.md).

With ``dataplane_workers`` on, what a peer's READs reach is a worker's
agent, not the daemon's: ``GetEngineInfo`` hands out the worker's metadata,
its addresses of the engine's regions and of the hold board; and the
engine's notices as a reader go out from the worker's notice agent, so what
holders are introduced to reaches the worker too. The engine's own READs are
posted by a second worker, its reader (:mod:`kvxferd.service.workers.readbackend`):
the daemon keeps no NIXL agent for such a rank (:class:`AgentlessSlot`)::

    daemon (control plane)                      worker of this engine rank
    ──────────────────────                      ──────────────────────────
    region fds (kept copies) ──── map ────────► the engine's regions, registered
    board memfd: HoldTable writes tags ───────► the same pages, registered
    Holder.on_notice on the data-plane thread ◄─ notices its agent received
    peer_view(): metadata, cache, board ◄─────── mapped {metadata, addresses}
    the executor's notices (WorkerNotices) ────► its notice agent: what holders are introduced to

A worker that dies is replaced with the same fds (the supervisor): the
board's tags and the hold table stay here, so no hold is lost; readers whose
READs it was serving fail them and handshake again, getting the new
worker's metadata (its agent name carries the generation). Peers see the
generation in the incarnation they are given (``<incarnation>.w<generation>``,
:meth:`EngineSlot.peer_incarnation`), so every reader's probe (every
``peer_check_s``) notices a new worker and handshakes again before its next
read, not after that read failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.errors import UnavailableError
from kvxferd.plan.board import BoardInfo
from kvxferd.plan.groups import EngineCache
from kvxferd.service.workers.generation import Region, WorkerUp
from kvxferd.service.workers.notices import WorkerNotices
from kvxferd.service.workers.supervisor import MIN_REPLACE_INTERVAL_S, RETIRE_GRACE_S, WorkerSupervisor
from kvxferd.service.workers.trust import HandedMetadata
from kvxferd.xfer.boardmemory import BoardMemory


@dataclass(frozen=True)
class AgentlessSlot:
    """The slot's agent where workers serve and read for it: a name, and nothing of NIXL in this process
    (nothing arrives, nothing is registered, no metadata is handed out)."""

    name: str

    def new_messages(self) -> list[tuple[str, bytes]]:
        return []

    def metadata(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


def rebased(cache: EngineCache, addresses: list[int] | tuple[int, ...]) -> EngineCache:
    """``cache`` with each region (groups in order, regions in order) at the next of ``addresses``."""
    it = iter(addresses)
    memory = tuple(tuple(dataclasses.replace(m, address=next(it)) for m in group) for group in cache.memory)
    return dataclasses.replace(cache, memory=memory)


@dataclass(frozen=True)
class WorkerOptions:
    """How a daemon runs its data-plane workers (its configuration, and the counters it keeps)."""

    poll_interval_s: float
    retire_grace_s: float = RETIRE_GRACE_S
    replace_interval_s: float = MIN_REPLACE_INTERVAL_S
    on_death: Callable[[], None] | None = None  # a worker ended unasked (any thread)
    on_replace: Callable[[tuple[str, ...]], None] | None = None  # a replacement started, for these reasons
    readers: bool = False  # the rank's own READs from a reader worker too (dataplane_reader_workers)


class WorkerServed:
    """The worker serving one engine rank, the board it shares with it, and its notice agent."""

    def __init__(self, name: str, region_fds: list[tuple[int, int, int]], board: BoardMemory,
                 on_notices: Callable[[list[tuple[str, bytes]]], None], options: WorkerOptions) -> None:
        """A worker for ``region_fds`` (fd, offset, num_bytes per region, in the cache's order) and ``board``,
        not started yet (:meth:`start`); ``on_generation`` (set before it) hears of each new generation."""
        regions = [Region(fd, num_bytes, offset) for fd, offset, num_bytes in region_fds]
        regions.append(Region(board.fd, board.words.nbytes))
        self.board, self.num_regions = board, len(region_fds)
        self.on_generation: Callable[[WorkerUp], None] | None = None
        self.closing = False
        self.handed = HandedMetadata()  # until when the serving generation's metadata may be trusted
        on_death = options.on_death
        self.supervisor = WorkerSupervisor(name, regions, poll_interval_s=options.poll_interval_s, on_up=self._up,
                                           retire_grace_s=options.retire_grace_s,
                                           min_replace_interval_s=options.replace_interval_s,
                                           on_notices=lambda generation, pairs: on_notices(pairs),
                                           on_death=lambda death: on_death and not self.closing and on_death(),
                                           on_replace=options.on_replace)
        self.notices = WorkerNotices(self.supervisor)  # the executor's notice agent (the engine as a reader)
        self.reader = None  # the rank's reader worker (WorkerReadBackend), the slot's executor: it closes it

    @property
    def failure(self) -> str:
        """Why a supervisor of this rank's workers gave up ("": none did)."""
        reader = self.reader
        return self.supervisor.failure or (reader.supervisor.failure if reader is not None else "")

    def start(self) -> None:
        """Start the first generation; blocks until it mapped everything (about 2 s)."""
        self.supervisor.start()

    def _up(self, up: WorkerUp) -> None:
        self.notices.reload(up)
        if self.on_generation is not None:
            self.on_generation(up)

    def peer_view(self, cache: EngineCache, board: BoardInfo) -> tuple[int, bytes, EngineCache, BoardInfo]:
        """What a peer is given: the worker's generation, metadata, cache addresses and board address."""
        up = self.supervisor.current
        if up is None:
            raise UnavailableError("engine_id", f"the data-plane worker of {cache.engine_id!r} is restarting: "
                                                "handshake again shortly")
        return (up.generation, up.metadata, rebased(cache, up.addresses[:self.num_regions]),
                dataclasses.replace(board, address=up.addresses[self.num_regions]))

    def replace(self, reason: str) -> None:
        """Trust in the metadata peers were handed ended (kvxferd.service.workers.trust): a new worker, make
        before break; the old one stops ``retire_grace_s`` after the new one is up."""
        if not self.closing:
            self.supervisor.replace(reason)

    @property
    def generation(self) -> int:
        """The generation serving now (0 while none is up)."""
        up = self.supervisor.current
        return 0 if up is None else up.generation

    def pace(self, poll_interval_s: float) -> None:
        """How often the worker makes progress: fast while a reader's READs need it (UCX over TCP), slowly
        while it only counts notices, rarely when idle (its polls cost about 5 % of a core at 1 ms)."""
        self.supervisor.pace(poll_interval_s)

    def close(self) -> None:
        """Stop the worker (its registrations go with it), then let go of the board."""
        self.closing = True  # its end from here on is asked for, not a death
        self.notices.close()
        self.supervisor.stop()  # also before it started: closes its read-only copies
        self.supervisor.forget_callbacks()  # they close over the slot: no cycle keeps its board mapped
        self.on_generation = None
        self.board.close()
