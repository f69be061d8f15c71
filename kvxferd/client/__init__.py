"""What an engine uses to talk to its kvxferd daemon.

* :class:`EngineClient`: the engine service (register, handshake, reads,
  holds, completions), heartbeats in the background.
* :class:`NotifySubscriber`: the notify bus, gap-free (missed events are
  fetched over gRPC).
* :class:`SharedArena` and :func:`engine_rank_pb`: host caches in POSIX
  shared memory, described for ``Register``.
* :class:`DaemonProcess`: start a daemon as a child process (tests, demo).
"""

from kvxferd.client.engine import EngineClient, Held
from kvxferd.client.launch import DaemonProcess
from kvxferd.client.notify import NotifySubscriber
from kvxferd.client.shm import SharedArena, engine_rank_pb

__all__ = ["DaemonProcess", "EngineClient", "Held", "NotifySubscriber", "SharedArena", "engine_rank_pb"]
