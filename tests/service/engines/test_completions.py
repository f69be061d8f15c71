"""An engine's completion feed with a sink (the reads socket): the data-plane thread writes a completion
itself only when the sink is caught up, so the sink sees every seq once and in order, however the
thread's writes and the loop's interleave; a new stream gets every unacked completion again."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.completions import CompletionFeed, StreamReplaced


class _Sink:
    """Records what it is sent, from which thread."""

    direct = True

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.threads: set[int] = set()
        self.writable_now, self.closed = True, False
        self._room = asyncio.Event()
        self._room.set()

    @property
    def writable(self) -> bool:
        return self.writable_now and not self.closed

    def send(self, completions) -> bool:
        if self.closed:
            return False
        self.seqs += [c.seq for c in completions]
        self.threads.add(threading.get_ident())
        return True

    async def wait_writable(self) -> None:
        await self._room.wait()

    def block(self) -> None:
        self.writable_now = False
        self._room.clear()

    def unblock(self) -> None:
        self.writable_now = True
        self._room.set()


def _completion(n: int) -> pb.Completion:
    return pb.Completion(request_id=f"r{n}", ok=True)


def _pumping(feed: CompletionFeed, sink: _Sink, stop=lambda: False) -> asyncio.Task:
    return asyncio.ensure_future(feed.pump(sink, 4, stop))


def test_a_completion_is_written_at_once_only_when_the_sink_has_everything_before_it():
    async def main():
        feed = CompletionFeed()
        assert not feed.put_direct(_completion(0)) and len(feed) == 0  # no stream: the loop queues it
        feed.put(_completion(0))
        feed.ack(1)  # an earlier stream's, acked: nothing for a new stream to resend
        sink = _Sink()
        pump = _pumping(feed, sink)
        await asyncio.sleep(0)
        assert feed.put_direct(_completion(1)) and sink.seqs == [2] and feed.has("r1")  # queued until acked
        feed.put(_completion(2))  # the loop's: the pump sends it on its next turn
        assert not feed.put_direct(_completion(3)) and sink.seqs == [2]  # 3 would come before 4: refused
        await asyncio.sleep(0)
        assert sink.seqs == [2, 3] and feed.put_direct(_completion(3)) and sink.seqs == [2, 3, 4]
        sink.block()
        assert not feed.put_direct(_completion(4))  # no room: the loop queues it, the pump waits for room
        feed.put(_completion(4))
        await asyncio.sleep(0.01)
        assert sink.seqs == [2, 3, 4]
        sink.unblock()
        await asyncio.sleep(0.01)
        assert sink.seqs == [2, 3, 4, 5] and feed.put_direct(_completion(5)) and sink.seqs[-1] == 6
        feed.close()
        assert not feed.put_direct(_completion(6))  # deregistering: the loop's path only
        await asyncio.wait_for(pump, 5)

    asyncio.run(main())


def test_a_threads_writes_and_the_loops_interleave_yet_every_seq_arrives_once_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        feed, sink = CompletionFeed(), _Sink()
        pump = _pumping(feed, sink)
        await asyncio.sleep(0)
        num_each = 2000

        def thread_side():  # as the data-plane thread: write now, else hand over to the loop
            for n in range(num_each):
                completion = _completion(n)
                if not feed.put_direct(completion):
                    loop.call_soon_threadsafe(feed.put, completion)

        thread = threading.Thread(target=thread_side)
        thread.start()
        for n in range(num_each):
            feed.put(_completion(num_each + n))
            if n % 7 == 0:
                await asyncio.sleep(0)
        while thread.is_alive() or len(sink.seqs) < 2 * num_each:
            await asyncio.sleep(0.001)
        assert sink.seqs == list(range(1, 2 * num_each + 1))
        assert len(sink.threads) == 2  # both wrote: the test exercised the race it claims to
        pump.cancel()

    asyncio.run(main())


def test_a_new_stream_gets_every_unacked_completion_once_and_the_old_sink_nothing_more():
    async def main():
        feed, first = CompletionFeed(), _Sink()
        pump = _pumping(feed, first)
        await asyncio.sleep(0)
        for n in range(1, 6):
            assert feed.put_direct(_completion(n))
        feed.ack(2)  # the engine had 1 and 2
        first.closed = True  # the connection broke
        assert not feed.put_direct(_completion(6))
        feed.put(_completion(6))
        await asyncio.wait_for(pump, 5)  # a closed sink ends its pump
        assert first.seqs == [1, 2, 3, 4, 5]
        second = _Sink()
        pump = _pumping(feed, second)
        await asyncio.sleep(0)
        assert second.seqs == [3, 4, 5, 6] and feed.put_direct(_completion(7)) and second.seqs[-1] == 7
        # A gRPC stream takes over: nobody writes to the old sink any more, the new stream gets the rest.
        stream = feed.batches(16)
        assert [c.seq for c in await stream.__anext__()] == [3, 4, 5, 6, 7]
        assert not feed.put_direct(_completion(8)) and second.seqs[-1] == 7
        await stream.aclose()
        pump.cancel()

    asyncio.run(main())


def test_a_grpc_stream_is_the_same_pump_one_batch_at_a_time_and_a_newer_stream_replaces_it():
    """A gRPC stream's sink holds one batch until the generator takes it (the pump waits: an engine that
    stops reading stops taking completions); the thread never writes to it; a closed feed drains first."""
    async def main():
        feed = CompletionFeed()
        for n in range(5):
            feed.put(_completion(n))
        stream = feed.batches(2)
        assert [c.seq for c in await stream.__anext__()] == [1, 2]
        await asyncio.sleep(0.01)
        assert feed._sink_sent_seq == 4  # the next batch waits in the sink; nothing after it was taken
        feed.put(_completion(5))
        assert [c.seq for c in await stream.__anext__()] == [3, 4]
        feed.close()
        assert [c.seq for c in await stream.__anext__()] == [5, 6]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

        feed = CompletionFeed()
        feed.put(_completion(0))
        first = feed.batches(8)
        assert [c.seq for c in await first.__anext__()] == [1]
        second = feed.batches(8)
        assert [c.seq for c in await second.__anext__()] == [1]  # unacked: sent again on the newer stream
        await asyncio.sleep(0.01)
        assert not feed.put_direct(_completion(1))  # caught up and room, but not the thread's to write
        with pytest.raises(StreamReplaced):
            await first.__anext__()
        await second.aclose()

    asyncio.run(main())


def _done(request_id: str) -> pb.Completion:
    return pb.Completion(request_id=request_id, ok=True)


def test_a_feed_handed_to_a_reader_worker_moves_whole_and_numbers_on_after_the_engines_ack():
    """The session's feed goes to the reader worker that takes the session (service/net/sessions.py): its
    unacked completions with their seqs, nothing left here; the same generation again gets nothing (it
    has the feed); another generation (the first died or was replaced) gets none of the lost ones and
    numbers on after the engine's ack, so no seq is used twice; serving a session here again (reclaim)
    numbers on after the ack too, and an ack far past anything sent is refused before it is a seq."""
    from kvxferd.errors import InvalidArgumentError

    feed = CompletionFeed()
    for request_id in ("a", "b", "c"):
        feed.put(_done(request_id))
    feed.ack(1)
    last_seq, unacked = feed.hand_over(1, ack_seq=1)
    assert (last_seq, [c.seq for c in unacked]) == (3, [2, 3])
    assert len(feed) == 2  # (nothing changes until handed)
    feed.handed(1, last_seq)
    assert len(feed) == 0 and not feed.has("b") and feed.worker_generation == 1
    assert feed.hand_over(1, ack_seq=3) is None  # generation 1 has it
    assert feed.hand_over(2, ack_seq=7) == (7, [])  # generation 1 numbered up to 7 (the engine has them)
    assert feed.hand_over(2, ack_seq=2) == (3, [])  # never below what this feed numbered
    feed.handed(2, 7)
    feed.reclaim(9)  # served here again: after the engine's ack
    assert feed.worker_generation == 0
    feed.put(_done("d"))
    assert feed.last_seq == 10
    feed.reclaim(100)  # not with a worker: nothing to take back
    assert feed.last_seq == 10
    with pytest.raises(InvalidArgumentError):
        CompletionFeed().hand_over(1, ack_seq=1 << 62)
