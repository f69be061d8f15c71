"""What an engine uses to talk to its kvxferd daemon.

* :class:`EngineClient`: the engine service's control side (register,
  heartbeats in the background, handshake, holds, unary calls); its
  :attr:`~EngineClient.reads` is the registration's :class:`ReadSession`
  (reads, numbered completions, holds on the reads socket).
* :class:`NotifySubscriber`: the notify bus, gap-free (missed events are
  fetched over gRPC).
* :class:`SharedArena` and :func:`engine_rank_pb`: host caches in POSIX
  shared memory, described for ``Register``.
* :class:`DaemonProcess`: start a daemon as a child process (tests, demo).
"""

from kvxferd.client.engine import EngineClient
from kvxferd.client.session import Held, ReadSession
from kvxferd.client.launch import DaemonProcess
from kvxferd.client.notify import NotifySubscriber
from kvxferd.client.shm import SharedArena, engine_rank_pb

__all__ = ["DaemonProcess", "EngineClient", "Held", "NotifySubscriber", "ReadSession", "SharedArena",
           "engine_rank_pb"]
