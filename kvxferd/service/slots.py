"""One registered engine rank inside the daemon.

A slot owns what the engine handed over (its mapped memory), the NIXL agent
and executor that register that memory, the holder (holds of its requests,
their board and the readers introduced to it) and the engine's completion
queue. The event loop and the data-plane thread share it; ``holds`` is
guarded by ``lock``, the executor's lists by ``executor.lock``, everything
else belongs to one side as marked.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvxferd.plan.groups import EngineCache
from kvxferd.plan.leases import HoldTable
from kvxferd.service.completions import CompletionFeed
from kvxferd.xfer.agent import NixlAgent
from kvxferd.xfer.holder import Holder, Reader
from kvxferd.xfer.reads import ReadExecutor


@dataclass(eq=False)
class ActiveRead:
    """A read the engine submitted and has not been told about yet (loop side)."""

    remote_engine_id: str
    remote_request_id: str
    submitted_s: float  # monotonic
    # Its completion was written by the data-plane thread (ReadDone.deliver_now): the read is over for the
    # engine, though the loop has not dropped this record yet. Set by that thread, read by the loop.
    delivered: bool = False
    # Its capabilities were checked at submit (else they wait for a re-handshake's new key): only a
    # verified read keeps its holders' leases alive while it waits.
    verified: bool = True


@dataclass(eq=False)
class EngineSlot:
    """An engine rank's registration."""

    cache: EngineCache
    incarnation: str
    agent: NixlAgent
    executor: ReadExecutor
    mapped: list  # MappedRegion / GPU mappings: closed after NIXL deregistration
    lease_s: float
    lease_expires_s: float  # monotonic; pushed back by heartbeats (loop side)
    holder: Holder  # its holds, their board (registered with ``agent``) and introduced readers
    completions: CompletionFeed = field(default_factory=CompletionFeed)  # loop side
    active: dict[str, ActiveRead] = field(default_factory=dict)  # loop side, by request id
    links: dict = field(default_factory=dict)  # remote engine id -> RemoteLink (loop side)
    allowed_readers: frozenset[str] = frozenset()  # empty: any reader engine
    session: str = ""  # the engine's proof of identity on later calls
    num_bytes: int = 0  # registered memory
    metadata: bytes = b""  # NIXL agent metadata after registration
    notices_metadata: bytes = b""  # of the executor's notice agent: how this rank introduces itself as a reader
    closing: bool = False

    @property
    def engine_id(self) -> str:
        return self.cache.engine_id

    @property
    def holds(self) -> HoldTable:
        """Shared with the data-plane thread: touch it under :attr:`lock`."""
        return self.holder.holds

    @property
    def lock(self) -> threading.Lock:
        return self.holder.lock

    @property
    def readers(self) -> dict[tuple[str, int], Reader]:
        """Introduced readers by (engine id, rank): written on the loop, read by the data-plane thread."""
        return self.holder.readers

    def heartbeat(self) -> None:
        self.lease_expires_s = time.monotonic() + self.lease_s

    def close_memory(self) -> None:
        """Unmap what the engine handed over (NIXL must have deregistered it)."""
        for mapping in self.mapped:
            mapping.close()
        self.mapped = []
