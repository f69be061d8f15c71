"""One registered engine rank inside the daemon.

A slot owns what the engine handed over (its mapped memory), the NIXL agent
that registers that memory and the backend its reads take (``executor``:
NIXL's ReadExecutor, behind the seam of ``xfer/backend.py``), the holder (holds of its requests,
their board and the readers introduced to it) and the engine's completion
queue. The event loop and the data-plane thread share it; ``holds`` is
guarded by ``lock``, the executor's lists by ``executor.lock``, everything
else belongs to one side as marked.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxferd.plan.board import BoardInfo
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.leases import HoldTable
from kvxferd.service.engines.completions import CompletionFeed
from kvxferd.service.engines.served import WorkerServed
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.holder import Holder
from kvxferd.xfer.readers import ReaderTable
from kvxferd.xfer.backend import ReadBackend
from kvxferd.xfer.pushes import PushExecutor
from kvxferd.xfer.reads import ReadExecutor

if TYPE_CHECKING:
    from kvxferd.service.engines.read import Read


@dataclass(eq=False)
class EngineSlot:
    """An engine rank's registration."""

    cache: EngineCache
    incarnation: str
    agent: NixlAgent
    executor: ReadBackend  # the data path its reads take (NIXL: xfer.reads.ReadExecutor)
    mapped: list  # MappedRegion / GPU mappings: closed after NIXL deregistration
    lease_s: float
    lease_expires_s: float  # monotonic; pushed back by heartbeats (loop side)
    holder: Holder  # its holds, their board (registered with ``agent``) and introduced readers
    completions: CompletionFeed = field(default_factory=CompletionFeed)  # loop side
    # Reads the engine submitted, by request id, until the loop kept their books (loop side; a read's
    # state may be advanced meanwhile by the data-plane thread: service/engines/read.py).
    reads: dict[str, Read] = field(default_factory=dict)
    links: dict = field(default_factory=dict)  # remote engine id -> RemoteLink (loop side)
    allowed_readers: frozenset[str] = frozenset()  # empty: any reader engine
    session: str = ""  # the engine's proof of identity on later calls
    num_bytes: int = 0  # registered memory
    metadata: bytes = b""  # NIXL agent metadata after registration
    notices_metadata: bytes = b""  # of the executor's notice agent: how this rank introduces itself as a reader
    closing: bool = False
    process_watch: object = None  # a ProcessWatch of the engine's process (engines/lifeline.py), if it passed one
    served: WorkerServed | None = None  # a data-plane worker serves this rank to peers (dataplane_workers)
    worker_reads_in_flight: int = 0  # its reader worker's, when it serves the engine's session (as it says)
    # Push (issue #57), loop side. As a decode rank: transfer id -> the engine's push read, completed when its
    # expectation (a hold of its blocks) ends. As a prefill rank: transfer id -> {(target engine, rank):
    # Expectation} waiting for this engine's hold or being written (service/reads/writer.py).
    expected: dict = field(default_factory=dict)
    expectations: dict = field(default_factory=dict)
    # prefill side: reader identity (the peer that introduced the decode rank) -> its expectations kept here;
    # the sum is the engine's: both bounds checked without a pass over the expectations
    num_expectations_by_owner: dict = field(default_factory=dict)
    expected_blocks: list = field(default_factory=list)  # decode side: per group, the blocks live expectations name
    # Decode side: transfer id -> a failed push whose blocks stay claimed until every writer that had not
    # reported did (late), or push_settle_s passed (service/reads/expect.py, Settling)
    settling: dict = field(default_factory=dict)
    heard_late: dict = field(default_factory=dict)  # transfer id -> writers whose late notice came before its end
    # Prefill side: transfer ids held for a push whose expectation has not come yet; until it comes (or
    # awaited_until_s) the data-plane thread polls for notices every EXPECT_POLL_S, not the holds' 10 ms.
    awaited: set = field(default_factory=set)
    # Prefill side: posted pushes (or stages) whose write has not ended -> the task waiting for it to end
    writing: dict = field(default_factory=dict)
    awaited_until_s: float = 0.0  # time.monotonic()
    # A push written layer by layer: FinalLayers that came before their hold (the engine's worker and its
    # scheduler reach the daemon on two sockets), request id -> (layers final or None: all, kept until).
    layers_ahead: dict = field(default_factory=dict)
    push_executor: PushExecutor | None = None  # made on the first push (pusher)

    @property
    def engine_id(self) -> str:
        return self.cache.engine_id

    @property
    def reader_worker(self):
        """Its reader worker (``WorkerReadBackend``: dataplane_reader_workers), or None."""
        return self.served.reader if self.served is not None else None

    @property
    def pusher(self) -> PushExecutor | None:
        """What writes this rank's blocks into decode ranks (built on its read executor); None when its
        reads run elsewhere (a reader worker): push is not built for that yet."""
        if self.push_executor is None and isinstance(self.executor, ReadExecutor) and self.served is None:
            self.push_executor = PushExecutor(self.executor)
        return self.push_executor

    @property
    def writer_agent_name(self) -> str:
        """The agent whose notices end this rank's writes ("": this rank does not push)."""
        pusher = self.pusher
        return pusher.notices.name if pusher is not None else ""

    @property
    def holds(self) -> HoldTable:
        """Shared with the data-plane thread: touch it under :attr:`lock`."""
        return self.holder.holds

    @property
    def lock(self) -> threading.Lock:
        return self.holder.lock

    @property
    def readers(self) -> ReaderTable:
        """Introduced readers by (engine id, rank) and identity: written on the loop, read by the data-plane
        thread."""
        return self.holder.readers

    def peer_view(self, trusted_until_s: float = math.inf) -> tuple[str, bytes, EngineCache, BoardInfo]:
        """What a peer is given to read this rank: its incarnation, agent metadata, the cache's addresses, the
        board's (a worker's when one serves it: :mod:`kvxferd.service.engines.served`). ``trusted_until_s``:
        when the certificate of whom it is given to expires (a worker is replaced before then)."""
        if self.served is None:
            return self.incarnation, self.metadata, self.cache, self.holder.board
        generation, *view = self.served.peer_view(self.cache, self.holder.board)
        self.served.handed.handed(generation, trusted_until_s)
        return (f"{self.incarnation}.w{generation}", *view)

    def peer_incarnation(self) -> str:
        """The incarnation peers compare (``GetIncarnation``): the registration's, and with a worker its
        generation too, so a new worker makes every reader handshake again. The engine's own (Register,
        Hold) stays the registration's: holds outlive a worker."""
        return self.incarnation if self.served is None else f"{self.incarnation}.w{self.served.generation}"

    def heartbeat(self) -> None:
        self.lease_expires_s = time.monotonic() + self.lease_s

    def close_memory(self) -> None:
        """Unmap what the engine handed over (NIXL must have deregistered it)."""
        for mapping in self.mapped:
            mapping.close()
        self.mapped = []
