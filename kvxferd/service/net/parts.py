"""What the request handlers may use of the daemon: a narrow, typed view instead of the object.

``servicers.py`` and ``readsock.py`` are written against :class:`DaemonParts`;
``daemon.py`` builds the parts and satisfies it. The layers below ask for less,
each through its own view (``engines/holding.py``'s :class:`HoldingParts`,
``reads/path.py``'s :class:`ReadPathParts`), so none of them imports this
layer. Nothing here imports the daemon at run time: no import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvxferd.service.engines.holding import HoldingParts
from kvxferd.service.reads.path import ReadPathParts

if TYPE_CHECKING:
    from kvxferd.plan.leases import HoldEnd
    from kvxferd.service.dataplane.thread import DataPlane
    from kvxferd.service.engines.slots import EngineSlot
    from kvxferd.service.net.bus import NotifyBus
    from kvxferd.service.reads.path import ReadPath
    from kvxferd.service.reads.writer import WritePath
    from kvxferd.service.net.sessions import WorkerSessions


class DaemonParts(HoldingParts, ReadPathParts, Protocol):
    """The daemon's parts a handler needs, and what it may ask of the daemon itself."""

    dataplane: DataPlane
    bus: NotifyBus
    reads: ReadPath
    writes: WritePath  # push, prefill side (issue #57)
    sessions: WorkerSessions  # reads sessions handed to reader workers
    addresses: dict[str, str]
    engine_token: str | None

    async def run_blocking(self, fn, *args):
        """A short blocking call off the event loop."""

    def publish(self, slot: EngineSlot, end: HoldEnd) -> None:
        """Publish a hold event on the notify bus (event-loop thread)."""
