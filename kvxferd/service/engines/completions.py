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

Every stream is :meth:`CompletionFeed.pump` writing to a sink; two kinds of sink:

* The reads socket (``service/net/readsock.py``): written on the loop by
  the pump, and by the data-plane thread, which may number and write an ok
  read's completion itself (:meth:`CompletionFeed.put_direct`) when the sink
  is caught up and writable; it skips the hop back to the loop
  (docs/benchmarks.md).
* A gRPC stream (:class:`StreamSink`, behind :meth:`CompletionFeed.batches`):
  the pump hands it one batch at a time, which the stream's generator
  yields; loop only. ``Reads`` keeps completions queued until the engine
  acks them (``ReadBatch.ack_seq``).

On either, a new stream after a broken one sends every unacked completion
again, so none is lost, and the engine drops the seqs it already has, so
none is seen twice.

Unacked completions count against the engine's limit of reads in flight,
so an engine that stops reading is refused new reads instead of growing
the daemon's memory. Deregistering ends the current stream after what is
queued has been sent. The event loop's thread does everything but
:meth:`CompletionFeed.put_direct`; a lock keeps numbering, queueing and
writing to a sink in one order, so the wire order is the seq order (an
engine drops a seq at or below the last it has as a duplicate).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base.status import StreamReplaced
from kvxferd.wire.frames import MAX_SEQ




def check_ack(ack_seq: int) -> None:
    """An ``ack_seq`` the feed may number on from: far below what a seq (uint64) holds."""
    if not 0 <= ack_seq < MAX_SEQ:
        raise InvalidArgumentError("ack_seq", f"{ack_seq} is past any seq this daemon numbers")  # at most this many completions in one CompletionBatch, on either transport


class CompletionSink(Protocol):
    """Where :meth:`CompletionFeed.pump` writes: a reads socket's session, or a :class:`StreamSink`."""

    direct: bool  # the data-plane thread may write to it (put_direct); else the loop only

    @property
    def writable(self) -> bool:
        """Room for more, and not closed (any thread)."""

    @property
    def closed(self) -> bool:
        """Gone for good: nothing it is given is written any more."""

    def send(self, completions: list[pb.Completion]) -> bool:
        """Write one batch, whole, after everything sent before; False once the sink is gone."""

    async def wait_writable(self) -> None:
        """Until :attr:`writable` (or the sink is gone)."""


class StreamSink:
    """A gRPC stream's end of the pump (event loop only): a batch waits here until the stream's generator
    takes it, and the pump waits meanwhile, so an engine that stops reading (gRPC's flow control holds
    the generator's yield) stops taking completions, as on the reads socket."""

    direct = False

    def __init__(self) -> None:
        self._batch: list[pb.Completion] | None = None
        self._news = asyncio.Event()  # a batch came, or the sink closed: for take()
        self._room = asyncio.Event()  # the batch was taken, or the sink closed: for the pump
        self.closed = False

    @property
    def writable(self) -> bool:
        return self._batch is None and not self.closed

    def send(self, completions: list[pb.Completion]) -> bool:
        if self.closed:
            return False
        self._batch = completions
        self._news.set()
        return True

    async def wait_writable(self) -> None:
        while self._batch is not None and not self.closed:
            self._room.clear()
            await self._room.wait()

    def close(self) -> None:
        """The pump ended: :meth:`take` hands out what it holds, then None."""
        self.closed = True
        self._news.set()
        self._room.set()

    async def take(self) -> list[pb.Completion] | None:
        """The next batch; None once the sink is closed and empty."""
        while self._batch is None:
            if self.closed:
                return None
            self._news.clear()
            await self._news.wait()
        batch, self._batch = self._batch, None
        self._room.set()
        return batch


class CompletionFeed:
    """Queued (unacked) completions plus the one stream allowed to take them."""

    def __init__(self) -> None:
        self._queued: collections.deque[pb.Completion] = collections.deque()  # seqs consecutive
        self._queued_ids: dict[str, int] = {}  # request id -> completions of it queued (a resend's check)
        self._next_seq = 1
        self._current: asyncio.Event | None = None  # the current stream's wake-up
        self.closed = False
        self._lock = threading.Lock()  # put_direct comes from the data-plane thread
        self._sink: CompletionSink | None = None  # the current stream's
        self._sink_sent_seq = 0  # the last seq written to the sink
        # Nonzero: the reader worker generation the feed was handed to with the engine's session
        # (service/net/sessions.py); it numbers from there, and this one is empty meanwhile.
        self.worker_generation = 0

    def __len__(self) -> int:
        """Completions queued and not yet acked."""
        return len(self._queued)

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def put(self, completion: pb.Completion) -> None:
        """Number and queue a completion; the current stream sends it (event loop)."""
        with self._lock:
            self._append(completion)
        if self._current is not None:
            self._current.set()

    def put_direct(self, completion: pb.Completion, taken: Callable[[], None] | None = None) -> bool:
        """Number, queue and write a completion to the current stream's sink now (any thread), when that
        sink has sent everything queued before and has room; False (nothing done) otherwise: then
        :meth:`put` it on the loop. ``taken`` runs once it is sure to go, before the write (the engine
        may answer it at once). Deregistering closes the feed to this path."""
        with self._lock:
            sink = self._sink
            if (sink is None or not sink.direct or self.closed or self._has_unsent(self._sink_sent_seq)
                    or not sink.writable):
                return False
            if taken is not None:
                taken()
            self._append(completion)
            self._sink_sent_seq = completion.seq
            if not sink.send([completion]):  # the sink is gone: queued, the next stream sends it
                self._sink = None
        return True

    def detach(self, sink: CompletionSink) -> None:
        """No more writes to ``sink`` (its session is ending); once this returns, none is under way."""
        with self._lock:
            if self._sink is sink:
                self._sink = None

    def _append(self, completion: pb.Completion) -> None:
        completion.seq = self._next_seq
        self._next_seq += 1
        self._queued.append(completion)
        self._queued_ids[completion.request_id] = self._queued_ids.get(completion.request_id, 0) + 1

    def ack(self, seq: int) -> None:
        """The engine has every completion up to ``seq``."""
        queued = self._queued
        with self._lock:
            while queued and queued[0].seq <= seq:
                self._forget(queued.popleft())

    def has(self, request_id: str) -> bool:
        """A completion of ``request_id`` is queued (not acked yet)."""
        with self._lock:
            return request_id in self._queued_ids

    def _forget(self, completion: pb.Completion) -> None:
        left = self._queued_ids.pop(completion.request_id) - 1
        if left:
            self._queued_ids[completion.request_id] = left

    def hand_over(self, generation: int, ack_seq: int) -> tuple[int, list[pb.Completion]] | None:
        """What a reader worker ``generation`` taking the engine's session needs of the feed: ``(last seq,
        unacked completions)``; None when that generation has the feed already. A worker that had it and
        is gone (dead, replaced) took its numbering along: it goes on after the engine's ``ack_seq``, the
        highest it has, so no seq is used twice. Nothing changes until :meth:`handed` (event loop)."""
        check_ack(ack_seq)
        with self._lock:
            if self.worker_generation == generation:
                return None
            if self.worker_generation:
                return max(self._next_seq - 1, ack_seq), []
            return self._next_seq - 1, list(self._queued)

    def handed(self, generation: int, last_seq: int) -> None:
        """The session and the feed went to ``generation``: nothing is queued here any more, and the stream
        that had it is replaced (event loop)."""
        with self._lock:
            self.worker_generation = generation
            self._next_seq = max(self._next_seq, last_seq + 1)
            self._queued.clear()
            self._queued_ids.clear()
            previous, self._current, self._sink = self._current, None, None
        if previous is not None:
            previous.set()  # it sees it was replaced

    def reclaim(self, ack_seq: int) -> None:
        """A session served here again while a reader worker had the feed (it is gone, or could not take
        the session): numbering goes on after the engine's ``ack_seq`` (event loop)."""
        check_ack(ack_seq)
        if self.worker_generation:
            with self._lock:
                self.worker_generation = 0
                self._next_seq = max(self._next_seq, ack_seq + 1)

    def close(self) -> None:
        """No more completions: the current stream ends once it has sent what is queued."""
        with self._lock:
            self.closed = True
        if self._current is not None:
            self._current.set()

    def _take_over(self, sink: CompletionSink) -> asyncio.Event:
        me = asyncio.Event()
        with self._lock:
            previous, self._current = self._current, me
            # A new stream sends every unacked completion again: "sent" is what comes before the oldest.
            self._sink = sink
            self._sink_sent_seq = self._queued[0].seq - 1 if self._queued else self._next_seq - 1
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

    def poke(self) -> None:
        """Wake the current stream (its ``should_stop`` may have turned true)."""
        if self._current is not None:
            self._current.set()

    async def batches(self, max_batch: int, should_stop=lambda: False) -> AsyncIterator[list[pb.Completion]]:
        """A gRPC stream's completions: :meth:`pump` into a :class:`StreamSink`, its batches yielded as they
        come, oldest unacked first; acks come via :meth:`ack`. Ends when ``should_stop()`` is true at a
        wake-up (see :meth:`poke`), or once the feed is closed and drained; raises :class:`StreamReplaced`
        when a newer stream took over."""
        sink = StreamSink()
        pumping = asyncio.ensure_future(self.pump(sink, max_batch, should_stop))
        pumping.add_done_callback(lambda _: sink.close())
        try:
            while (batch := await sink.take()) is not None:
                yield batch
            pumping.result()  # raises StreamReplaced
        finally:
            pumping.cancel()

    async def pump(self, sink: CompletionSink, max_batch: int, should_stop: Callable[[], bool]) -> None:
        """The one way out: every completion not sent on this stream yet, oldest unacked first, written to
        ``sink`` in batches inside the feed's lock, so that :meth:`put_direct` may write to a direct sink
        too: seqs go out in order, each once per stream. Waits while the sink has no room; returns once
        the sink is closed (what it did not take stays queued for the next stream), ``should_stop()``
        is true at a wake-up, or the feed is closed and drained; raises :class:`StreamReplaced` when a
        newer stream took over."""
        me = self._take_over(sink)
        try:
            while not should_stop():
                with self._lock:
                    if self._current is me and (self._sink is not sink or sink.closed):
                        return
                    while self._current is me and sink.writable and self._has_unsent(self._sink_sent_seq):
                        batch = self._unsent(self._sink_sent_seq, max_batch)
                        self._sink_sent_seq = batch[-1].seq
                        if not sink.send(batch):
                            self._sink = None
                            return
                    blocked = self._current is me and not sink.writable and self._has_unsent(self._sink_sent_seq)
                if blocked:
                    await sink.wait_writable()  # an engine that stops reading stops taking completions
                elif not await self._wait(me):
                    return
        finally:
            self._leave(me)

    def _has_unsent(self, sent_seq: int) -> bool:
        """Some queued completion comes after ``sent_seq``."""
        return bool(self._queued) and self._queued[-1].seq > sent_seq

    def _unsent(self, sent_seq: int, max_batch: int) -> list[pb.Completion]:
        """Under the lock: up to ``max_batch`` queued completions after ``sent_seq``, oldest first."""
        first = max(0, sent_seq + 1 - self._queued[0].seq)
        return list(itertools.islice(self._queued, first, first + max_batch))

    def _leave(self, me: asyncio.Event) -> None:
        with self._lock:
            if self._current is me:
                self._current, self._sink = None, None
