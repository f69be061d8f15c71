"""An engine rank whose memory a data-plane worker serves to peers (issue #55, docs/dataplane.md).

With ``dataplane_workers`` on, what a peer's READs reach is a worker's
agent, not the daemon's: ``GetEngineInfo`` hands out the worker's metadata,
its addresses of the engine's regions and of the hold board. The daemon
keeps its own agent for its reads (the engine as a reader) and never hands
that agent's metadata to a holder's readers::

    daemon (control plane)                      worker of this engine rank
    ──────────────────────                      ──────────────────────────
    region fds (kept copies) ──── map ────────► the engine's regions, registered
    board memfd: HoldTable writes tags ───────► the same pages, registered
    Holder.on_notice on the data-plane thread ◄─ notices its agent received
    peer_view(): metadata, cache, board ◄─────── mapped {metadata, addresses}

A worker that dies is replaced with the same fds (the supervisor): the
board's tags and the hold table stay here, so no hold is lost; readers whose
READs it was serving fail them and handshake again, getting the new
worker's metadata (its agent name carries the generation).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import UnavailableError
from kvxferd.plan.board import BoardInfo, board_shape
from kvxferd.plan.groups import EngineCache
from kvxferd.service.workers.supervisor import Region, WorkerSupervisor


@dataclass(eq=False)
class BoardMemory:
    """A hold board's words in a memfd: written here, registered by the worker, kept across its deaths."""

    fd: int
    mapping: mmap.mmap = field(repr=False)
    words: np.ndarray = field(repr=False)

    @classmethod
    def create(cls, num_buckets: int) -> "BoardMemory":
        shape = board_shape(num_buckets)
        num_bytes = int(np.prod(shape)) * 8
        fd = os.memfd_create("kvxferd-hold-board", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, num_bytes)
            mapping = mmap.mmap(fd, num_bytes)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, mapping, np.frombuffer(mapping, dtype=np.uint64).reshape(shape))

    def close(self) -> None:
        self.words = np.zeros(0, dtype=np.uint64)
        self.mapping.close()
        os.close(self.fd)


def rebased(cache: EngineCache, addresses: list[int] | tuple[int, ...]) -> EngineCache:
    """``cache`` with each region (groups in order, regions in order) at the next of ``addresses``."""
    it = iter(addresses)
    memory = tuple(tuple(dataclasses.replace(m, address=next(it)) for m in group) for group in cache.memory)
    return dataclasses.replace(cache, memory=memory)


@dataclass(eq=False)
class WorkerServed:
    """The worker serving one engine rank, and the board it shares with it."""

    supervisor: WorkerSupervisor
    board: BoardMemory
    num_regions: int

    @classmethod
    def start(cls, name: str, region_fds: list[tuple[int, int, int]], board: BoardMemory,
              on_notices, poll_interval_s: float) -> "WorkerServed":
        """Start the worker for ``region_fds`` (fd, offset, num_bytes per region, in the cache's order) and
        ``board``; blocks until it mapped them (about 2 s)."""
        regions = [Region(fd, num_bytes, offset) for fd, offset, num_bytes in region_fds]
        regions.append(Region(board.fd, board.words.nbytes))
        supervisor = WorkerSupervisor(name, regions, poll_interval_s=poll_interval_s,
                                      on_notices=lambda generation, pairs: on_notices(pairs))
        supervisor.start()
        return cls(supervisor, board, len(region_fds))

    def peer_view(self, cache: EngineCache, board: BoardInfo) -> tuple[bytes, EngineCache, BoardInfo]:
        """What a peer is given: the worker's metadata, cache addresses and board address."""
        up = self.supervisor.current
        if up is None:
            raise UnavailableError("engine_id", f"the data-plane worker of {cache.engine_id!r} is restarting: "
                                                "handshake again shortly")
        return (up.metadata, rebased(cache, up.addresses[:self.num_regions]),
                dataclasses.replace(board, address=up.addresses[self.num_regions]))

    def pace(self, poll_interval_s: float) -> None:
        """How often the worker makes progress: fast while a reader's READs need it (UCX over TCP), slowly
        while it only counts notices, rarely when idle (its polls cost about 5 % of a core at 1 ms)."""
        self.supervisor.pace(poll_interval_s)

    def close(self) -> None:
        """Stop the worker (its registrations go with it), then let go of the board."""
        self.supervisor.stop()
        self.board.close()
