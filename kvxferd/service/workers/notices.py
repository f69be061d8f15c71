"""The executor's notice agent, living in the engine's data-plane worker (issue #55, docs/dataplane.md).

A reader introduces itself to every holder it reads with its notice agent's
metadata: over UCX's TCP lane that metadata reaches whatever process serves
the agent. With a worker, that is the worker (which holds no secret), not
the daemon. This class stands in for the :class:`~kvxferd.xfer.nixl.agent.NixlAgent`
the executor sends its notices from, with the calls the executor makes of it::

    executor (daemon)                       worker
    add_remote(holder metadata) ──load───►  notice agent loads it (once per name; counted here)
    connect_to(name)            ──connect─► sets the connection up now
    notify(name, notice)        (kept)      batched: sent once the oldest waited NOTICE_BATCH_S
    poll_notifications()        ──notify──► the batch, one message: sent in order, then polled
                                            every 10 ms for 50 ms
    remove_remote(name)         ──unload──► at the last reference
    metadata()                  ◄─────────  the current generation's notice agent

Notices wait here for each other: a worker woken per notice cost about 0.3 ms
of CPU a wake-up on a 2-core VM (docs/benchmarks.md). A notice is sent at the
first poll after it has waited NOTICE_BATCH_S (the executor polls after each
read's notices, the data-plane thread every NOTICE_POLL_S while notices are
recent), so a hold ends CONSUMED at most about two of those polls later; an
unload sends the batch first (its notices name that agent).

A notice goes out from the notice agent its holder was introduced to: the
generation current when the holder was last added (each handshake adds it).
After a replacement that is the retiring generation, which serves its grace
until the reader's probe has handshaken again and re-introduced the new one;
notices the new agent sent meanwhile were dropped by the holder (not from the
agent it knows), their holds ending ``EXPIRED``. A generation that died
cannot send them: they go from the current one (dropped the same way).

Nothing waits for an answer: the daemon's own agent loaded the same
metadata first (``Connections.connect``), so the worker's load cannot fail
for the bytes; a worker that refuses anyway says so in an ``error`` line,
and those holders' holds end ``EXPIRED`` instead of ``CONSUMED``. A new
generation gets every holder still referenced loaded again (:meth:`reload`,
as it is published, under the supervisor's ``up_lock``; the worker loads a name once, however
often it is told, and the references are counted here).
"""

from __future__ import annotations

import time

from kvxferd.errors import UnavailableError
from kvxferd.wire import workerchannel as channel
from kvxferd.service.workers.generation import WorkerUp
from kvxferd.service.workers.supervisor import WorkerSupervisor
from kvxferd.xfer.nixl.agent import RemoteRefs, agent_name_of

NOTICE_BATCH_S = 0.005  # how long a notice waits for others (below the data plane's 10 ms NOTICE_POLL_S)


class WorkerNotices:
    """A notice agent in a worker, as the executor uses one."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self.supervisor = supervisor
        # The supervisor's: a new generation is published and reloaded under it, so no load, unload or
        # notice goes to it before the loads of reload (a notice for an agent not loaded would be lost).
        self._lock = supervisor.up_lock
        self._remotes = RemoteRefs()
        self._pending: list[list[str]] = []  # [agent name, notice hex], in the order they were sent
        self._introduced: dict[str, int] = {}  # holder agent name -> the generation current when last added
        self._pending_since_s = 0.0  # time.monotonic() of the oldest pending notice

    @property
    def name(self) -> str:
        return agent_name_of(self.metadata())

    def metadata(self) -> bytes:
        up = self.supervisor.current
        if up is None:
            raise UnavailableError("worker", f"the data-plane worker {self.supervisor.name!r} is restarting")
        return up.notices_metadata

    def add_remote(self, metadata: bytes, field: str = "agent_metadata") -> str:
        """Load a holder's metadata in the worker (counted per agent name, as NixlAgent.add_remote)."""
        name = agent_name_of(metadata, field)
        with self._lock:
            if self._remotes.add(name, metadata, field):
                self.supervisor.send({"op": "load", "metadata": metadata.hex()})
            self._introduced[name] = self.supervisor.serving_generation  # a handshake introduced this one
        return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if self._remotes.remove(name):
                self._flush()  # its notices before it is unloaded
                self._introduced.pop(name, None)
                self.supervisor.send({"op": "unload", "agent": name})

    def connect_to(self, agent_name: str) -> None:
        with self._lock:
            self.supervisor.send({"op": "connect", "agent": agent_name})

    def notify(self, agent_name: str, message: bytes) -> None:
        """Queue a notice for the next batch (sent at once when the batch is full)."""
        with self._lock:
            if not self._pending:
                self._pending_since_s = time.monotonic()
            self._pending.append([agent_name, message.hex()])
            if len(self._pending) >= channel.MAX_NOTICES:
                self._flush()

    def poll_notifications(self) -> dict:
        """Send the batch once its oldest notice has waited NOTICE_BATCH_S (the worker polls its notice
        agent after each batch); nothing is received here."""
        if not self._pending:  # read without the lock: a notice queued meanwhile waits for the next poll
            return {}
        with self._lock:
            if self._pending and time.monotonic() - self._pending_since_s >= NOTICE_BATCH_S:
                self._flush()
        return {}

    def _flush(self) -> None:
        """The pending notices in one message per generation they go from (under the lock), in order. Lost
        if no generation serves (those holds end EXPIRED, as for any notice a dead worker had not sent)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        serving = self.supervisor.serving_generation
        by_generation: dict[int, list[list[str]]] = {}
        for notice in pending:
            by_generation.setdefault(self._introduced.get(notice[0], serving), []).append(notice)
        for generation, notices in by_generation.items():
            for part in _within_message(notices):
                message = {"op": "notify", "notices": part}
                if generation == serving or not self.supervisor.send_to(generation, message):
                    self.supervisor.send(message)  # introduced to a generation that is gone: the current one

    def reload(self, up: WorkerUp) -> None:
        """A new generation: load every holder still referenced again (on the supervisor's thread, which
        holds the lock already: it published the generation under it)."""
        with self._lock:
            for name, metadata in self._remotes.metadata().items():
                self.supervisor.send({"op": "load", "metadata": metadata.hex()})
                self.supervisor.send({"op": "connect", "agent": name})  # now, not on its first notice

    def close(self) -> None:
        with self._lock:
            self._pending = []
            self._introduced.clear()
            self._remotes.clear()


def _within_message(notices: list[list[str]]):
    """``notices`` in parts that each fit one channel message (JSON may write a name's character as 6)."""
    part, part_bytes = [], 0
    for notice in notices:
        num_bytes = 6 * len(notice[0]) + len(notice[1]) + 16
        if part and part_bytes + num_bytes > channel.MAX_MESSAGE_BYTES // 2:
            yield part
            part, part_bytes = [], 0
        part.append(notice)
        part_bytes += num_bytes
    if part:
        yield part
