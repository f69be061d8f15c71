"""What the request handlers may use of the daemon: a narrow, typed view instead of the object.

``servicers.py``, ``readsock.py`` and ``reads.py`` are written against :class:`DaemonParts`;
``daemon.py`` builds the parts and satisfies it. Nothing here imports the
daemon at run time, so there is no import circle.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvxferd.plan.leases import HoldEnd
    from kvxferd.service.net.bus import NotifyBus
    from kvxferd.service.config import DaemonConfig
    from kvxferd.service.reads.dataplane import DataPlane
    from kvxferd.service.engines.registry import Registry
    from kvxferd.service.metrics import Metrics
    from kvxferd.service.peers.links import Peers, RemoteLink
    from kvxferd.service.reads.path import ReadPath
    from kvxferd.service.engines.slots import EngineSlot


class DaemonParts(Protocol):
    """The daemon's parts a handler needs, and the three things it may ask of the daemon itself."""

    config: DaemonConfig
    metrics: Metrics
    registry: Registry
    bus: NotifyBus
    peers: Peers
    dataplane: DataPlane
    reads: ReadPath
    addresses: dict[str, str]
    engine_token: str | None

    def spawn(self, coro) -> asyncio.Task:
        """Run a coroutine in the background, cancelled at shutdown."""

    async def run_blocking(self, fn, *args):
        """A short blocking call off the event loop."""

    def publish(self, slot: EngineSlot, end: HoldEnd) -> None:
        """Publish a hold event on the notify bus (event-loop thread)."""

    def wake_maintenance(self) -> None:
        """A first hold arrived: leave the idle maintenance tick now."""

    def probe_soon(self, slot: EngineSlot, link: RemoteLink) -> None:
        """Ask the remote engine's ranks for their incarnations soon (rate-limited per link)."""
