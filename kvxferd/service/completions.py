"""An engine's completions, numbered, delivered to exactly one stream at a time.

Reads finish on the data-plane thread and are queued here on the event
loop, each with the next sequence number of the registration. One stream
takes them at a time; a second stream for the same engine *replaces* the
first, which ends with ``ABORTED`` (two streams must never race for one
engine's completions, each getting some)::

    put ──► [c5 c6 c7 c8] ──► current stream ──► engine
             ▲ acked up to 4      ▲
             │                    └─ new stream: takes over, starts again at the oldest unacked
    ack(seq) drops c <= seq

Two kinds of stream:

* ``Reads`` (:meth:`CompletionFeed.batches`): completions stay queued until
  the engine acks them (``ReadBatch.ack_seq``); a new stream after a broken
  one sends every unacked completion again, so none is lost, and the engine
  drops the seqs it already has, so none is seen twice.
* ``WatchCompletions`` (:meth:`CompletionFeed.stream`): a completion counts
  as acked once handed to gRPC (the simple, at-most-once path).

Unacked completions count against the engine's limit of reads in flight,
so an engine that stops reading is refused new reads instead of growing
the daemon's memory. Deregistering ends the current stream after what is
queued has been sent. Only the event loop's thread touches a feed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator

from kvxferd.proto.v1 import kvxfer_pb2 as pb


COMPLETIONS_PER_BATCH = 256  # at most this many completions in one CompletionBatch, on either transport


class StreamReplaced(Exception):
    """A newer stream took over this engine's completions."""


class CompletionFeed:
    """Queued (unacked) completions plus the one stream allowed to take them."""

    def __init__(self) -> None:
        self._queued: collections.deque[pb.Completion] = collections.deque()  # seqs consecutive
        self._queued_ids: dict[str, int] = {}  # request id -> completions of it queued (a resend's check)
        self._next_seq = 1
        self._current: asyncio.Event | None = None  # the current stream's wake-up
        self.closed = False

    def __len__(self) -> int:
        """Completions queued and not yet acked."""
        return len(self._queued)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def put(self, completion: pb.Completion) -> None:
        completion.seq = self._next_seq
        self._next_seq += 1
        self._queued.append(completion)
        self._queued_ids[completion.request_id] = self._queued_ids.get(completion.request_id, 0) + 1
        if self._current is not None:
            self._current.set()

    def ack(self, seq: int) -> None:
        """The engine has every completion up to ``seq``."""
        queued = self._queued
        while queued and queued[0].seq <= seq:
            self._forget(queued.popleft())

    def has(self, request_id: str) -> bool:
        """A completion of ``request_id`` is queued (not acked yet)."""
        return request_id in self._queued_ids

    def _forget(self, completion: pb.Completion) -> pb.Completion:
        left = self._queued_ids.pop(completion.request_id) - 1
        if left:
            self._queued_ids[completion.request_id] = left
        return completion

    def close(self) -> None:
        """No more completions: the current stream ends once it has sent what is queued."""
        self.closed = True
        if self._current is not None:
            self._current.set()

    def _take_over(self) -> asyncio.Event:
        me = asyncio.Event()
        previous, self._current = self._current, me
        if previous is not None:
            previous.set()  # wakes the older stream so it sees it was replaced
        return me

    async def _wait(self, me: asyncio.Event) -> bool:
        """False once replaced or closed-and-drained; else waits for news."""
        if self._current is not me:
            raise StreamReplaced("another completion stream of this engine replaced this one")
        if self.closed:
            return False
        me.clear()
        await me.wait()
        return True

    async def stream(self) -> AsyncIterator[pb.Completion]:
        """Take completions in order until :meth:`close` (each acked as it is handed over)."""
        me = self._take_over()
        try:
            while True:
                while self._queued and self._current is me:
                    yield self._forget(self._queued.popleft())
                if not await self._wait(me):
                    return
        finally:
            if self._current is me:
                self._current = None

    def poke(self) -> None:
        """Wake the current stream (its ``should_stop`` may have turned true)."""
        if self._current is not None:
            self._current.set()

    async def batches(self, max_batch: int, should_stop=lambda: False) -> AsyncIterator[list[pb.Completion]]:
        """Lists of completions not sent on this stream yet, oldest unacked first; acks come via :meth:`ack`.

        Ends when ``should_stop()`` is true at a wake-up (see :meth:`poke`).
        """
        me = self._take_over()
        sent_seq = 0  # a new stream sends every unacked completion again
        try:
            while not should_stop():
                while self._queued and self._current is me and self._queued[-1].seq > sent_seq:
                    first = max(0, sent_seq + 1 - self._queued[0].seq)
                    batch = list(itertools.islice(self._queued, first, first + max_batch))
                    sent_seq = batch[-1].seq
                    yield batch
                    if should_stop():
                        return
                if not await self._wait(me):
                    return
        finally:
            if self._current is me:
                self._current = None
