"""The executor's notice agent, living in the engine's data-plane worker (issue #55, docs/dataplane.md).

A reader introduces itself to every holder it reads with its notice agent's
metadata: over UCX's TCP lane that metadata reaches whatever process serves
the agent. With a worker, that is the worker (which holds no secret), not
the daemon. This class stands in for the :class:`~kvxferd.xfer.nixl.agent.NixlAgent`
the executor sends its notices from, with the calls the executor makes of it::

    executor (daemon)                       worker
    add_remote(holder metadata) ──load───►  notice agent loads it (once per name; counted here)
    connect_to(name)            ──connect─► sets the connection up now
    notify(name, notice)        ──notify──► sends it, then polls every 10 ms for 50 ms
    remove_remote(name)         ──unload──► at the last reference
    metadata()                  ◄─────────  the current generation's notice agent

Nothing waits for an answer: the daemon's own agent loaded the same
metadata first (``Connections.connect``), so the worker's load cannot fail
for the bytes; a worker that refuses anyway says so in an ``error`` line,
and those holders' holds end ``EXPIRED`` instead of ``CONSUMED``. A new
generation gets every holder still referenced loaded again (:meth:`reload`,
as it is published, under the supervisor's ``up_lock``; the worker loads a name once, however
often it is told, and the references are counted here).
"""

from __future__ import annotations

from kvxferd.errors import UnavailableError
from kvxferd.service.workers.generation import WorkerUp
from kvxferd.service.workers.supervisor import WorkerSupervisor
from kvxferd.xfer.nixl.agent import RemoteRefs, agent_name_of


class WorkerNotices:
    """A notice agent in a worker, as the executor uses one."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self.supervisor = supervisor
        # The supervisor's: a new generation is published and reloaded under it, so no load, unload or
        # notice goes to it before the loads of reload (a notice for an agent not loaded would be lost).
        self._lock = supervisor.up_lock
        self._remotes = RemoteRefs()

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
        return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if self._remotes.remove(name):
                self.supervisor.send({"op": "unload", "agent": name})

    def connect_to(self, agent_name: str) -> None:
        with self._lock:
            self.supervisor.send({"op": "connect", "agent": agent_name})

    def notify(self, agent_name: str, message: bytes) -> None:
        with self._lock:
            self.supervisor.send({"op": "notify", "agent": agent_name, "data": message.hex()})

    def poll_notifications(self) -> dict:
        """Nothing to do here: the worker polls its notice agent after each notice."""
        return {}

    def reload(self, up: WorkerUp) -> None:
        """A new generation: load every holder still referenced again (on the supervisor's thread, which
        holds the lock already: it published the generation under it)."""
        with self._lock:
            for name, metadata in self._remotes.metadata().items():
                self.supervisor.send({"op": "load", "metadata": metadata.hex()})
                self.supervisor.send({"op": "connect", "agent": name})  # now, not on its first notice

    def close(self) -> None:
        with self._lock:
            self._remotes.clear()
