"""An engine's completions, delivered to exactly one stream at a time.

Reads finish on the data-plane thread and are queued here on the event
loop; the engine's ``WatchCompletions`` stream takes them in order. A
second stream for the same engine *replaces* the first, which ends with
``ABORTED`` (two streams must never race for one engine's completions,
each getting some). Deregistering ends the current stream after what is
queued has been sent::

    put ──► [c1 c2 c3] ──► current stream ──► engine
                              ▲
    new stream ───────────────┘  (the old one wakes, sees it was replaced, ends ABORTED)

Only the event loop's thread touches a feed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

from kvxferd.proto.v1 import kvxfer_pb2 as pb


class StreamReplaced(Exception):
    """A newer stream took over this engine's completions."""


class CompletionFeed:
    """Queued completions plus the one stream allowed to take them."""

    def __init__(self) -> None:
        self._queued: collections.deque[pb.Completion] = collections.deque()
        self._current: asyncio.Event | None = None  # the current stream's wake-up
        self.closed = False

    def __len__(self) -> int:
        return len(self._queued)

    def put(self, completion: pb.Completion) -> None:
        self._queued.append(completion)
        if self._current is not None:
            self._current.set()

    def close(self) -> None:
        """No more completions: the current stream ends once it has sent what is queued."""
        self.closed = True
        if self._current is not None:
            self._current.set()

    async def stream(self) -> AsyncIterator[pb.Completion]:
        """Take completions in order until :meth:`close`; raises :class:`StreamReplaced` when superseded."""
        me = asyncio.Event()
        previous, self._current = self._current, me
        if previous is not None:
            previous.set()  # wakes the older stream so it sees it was replaced
        try:
            while True:
                while self._queued and self._current is me:
                    yield self._queued.popleft()
                if self._current is not me:
                    raise StreamReplaced("another WatchCompletions stream of this engine replaced this one")
                if self.closed:
                    return
                me.clear()
                await me.wait()
        finally:
            if self._current is me:
                self._current = None
