"""The data plane in process, over real NIXL: a read posted on the calling thread (``post_now``) and one
posted by the data-plane thread end the same way, and a small read that does not end within its post is
handed over and ends on the thread; the thread writes an ok read's completion to the engine's session
itself.

The executors and holders come from :class:`LocalCluster` (one prefill and one decode rank, boards and
notice agents as in a daemon); the decode rank gets a daemon slot and a running :class:`DataPlane`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import types
from collections.abc import Callable

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.dataplane import thread as dataplane_module
from kvxferd.service.dataplane.thread import DataPlane
from kvxferd.service.engines.read import Read, ReadState
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer import holder as holder_module
from kvxferd.xfer.holder import Holder, NoticeEvent, Reader
from kvxferd.xfer.admission import admit
from kvxferd.xfer.handles import ReadFailure


@pytest.fixture(scope="module")
def plane():
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    with LocalCluster(prefill_groups, decode_groups, 1, 1, name="plane") as cluster:
        executor = cluster.executors[0]
        slot = EngineSlot(cluster.decode[0].cache, "inc", executor.agent, executor, [], 60.0, 0.0,
                          Holder(executor.agent, max_holds=16))
        done: queue.SimpleQueue[Read] = queue.SimpleQueue()
        dataplane = DataPlane(lambda finished: [done.put(d) for d in finished], lambda events: None)
        dataplane.start()
        dataplane.call(lambda: dataplane.add_slot(slot)).result(10)
        # The first READs of a new pair of agents wait for the owner (connection set-up; the second one
        # too, in 0.4 ms against 5 µs later): warm up.
        for n in range(3):
            warm = random_request(f"warm-{n}", prefill_groups, decode_groups, 48, np.random.default_rng(n))
            assert all(r.ok for r in cluster.read(warm)) and cluster.holder_thread.wait_end(0, warm.remote_request_id)
        try:
            yield cluster, slot, dataplane, done
        finally:
            dataplane.stop()
            slot.holder.close()


def _read(cluster, slot, request_id: str, seed: int) -> Read:
    request = cluster.hold(random_request(request_id, cluster.prefill_groups, cluster.decode_groups, 48,
                                          np.random.default_rng(seed)), 60)
    remote = slot.executor.remote(cluster.prefill_id)
    now = time.perf_counter()
    return Read(slot, cluster.prefill_id, request, remote, now, now + 10, admit(remote, request))


def _consumed(cluster, read: Read) -> bool:
    end = cluster.holder_thread.wait_end(0, read.planned.request.remote_request_id)
    return end is not None and end.kind == "CONSUMED"


def test_posted_here_or_on_the_thread_a_read_ends_the_same(plane, monkeypatch):
    cluster, slot, dataplane, done = plane
    cluster.reset_decode()
    here = _read(cluster, slot, "here", 1)
    # Host memory: the copy ends within the post, the board check a few µs later; a loaded machine may
    # take longer than the 50 µs post_now waits, so wait for it here (the hand-over has its own test).
    monkeypatch.setattr(dataplane_module, "INLINE_CHECK_WAIT_S", 5.0)
    assert dataplane.post_now(here)
    assert here.state is ReadState.ENDED and here.result.ok and here.failure is ReadFailure.NONE
    assert here.post_s > 0 and here.stages_s[2] > 0 and cluster.check(here.planned.request) == []
    # The holders hear of it only once the loop handed the completion on and sent the notices.
    assert cluster.holder_thread.wait_end(0, here.planned.request.remote_request_id, timeout_s=0.2) is None
    dataplane.send_notices(here)
    dataplane.send_notices(here)  # once only: a second call sends nothing (no second notice, no late one)
    assert _consumed(cluster, here)
    time.sleep(0.05)  # a second notice would reach the holder now: late, for a hold that ended
    assert cluster.holders[0].counts[NoticeEvent.LATE] == 0
    cluster.reset_decode()
    there = _read(cluster, slot, "there", 2)
    dataplane.submit(there)
    ended = done.get(timeout=10)
    assert ended is there and there.result.ok and cluster.check(there.planned.request) == []
    assert _consumed(cluster, there) and dataplane.num_reads == 0


def test_a_read_handed_over_unplanned_is_planned_on_the_thread_and_bad_ids_are_refused(plane):
    cluster, slot, dataplane, done = plane
    cluster.reset_decode()
    good, bad = _read(cluster, slot, "unplanned", 5), _read(cluster, slot, "unplanned-bad", 6)
    request = bad.request
    bad.request = dataclasses.replace(request, local_block_ids=tuple(ids + 10_000 for ids in request.local_block_ids))
    for read in (good, bad):
        read.admitted = admit(read.remote, read.request, plan=False)  # sealed on the loop, planned there
        dataplane.submit(read)
    ended = {d.result.request_id: d for d in (done.get(timeout=10), done.get(timeout=10))}
    assert ended["unplanned"].result.ok and ended["unplanned"].refusal is None and ended["unplanned"].stages_s[0] > 0
    assert cluster.check(good.request) == [] and _consumed(cluster, good)
    refused = ended["unplanned-bad"]
    assert isinstance(refused.refusal, InvalidArgumentError) and refused.failure is ReadFailure.REFUSED
    assert not refused.result.ok and refused.post_s == 0 and bad.inflight is None  # nothing was posted
    assert dataplane.num_reads == 0


def test_the_thread_writes_an_ok_reads_completion_itself_before_the_hop_and_a_failed_ones_not(plane):
    """The engine's session has a sink (its reads socket): the data-plane thread numbers and writes an ok
    read's completion before it hands the round to the loop; a read that failed goes the loop's way."""
    cluster, slot, dataplane, done = plane
    cluster.reset_decode()
    written: list[tuple[str, int]] = []
    sink = types.SimpleNamespace(direct=True, writable=True, closed=False, send=lambda completions: written.extend(
        (c.request_id, threading.get_ident()) for c in completions) or True)

    async def main():
        loop = asyncio.get_running_loop()
        pump = asyncio.ensure_future(slot.completions.pump(sink, 8, lambda: False))
        await asyncio.sleep(0)
        good, late = _read(cluster, slot, "direct", 7), _read(cluster, slot, "direct-late", 8)
        late.deadline_s = 0.0
        for read in (good, late):
            dataplane.submit(read)
        ended = {d.result.request_id: d for d in [await loop.run_in_executor(None, done.get, True, 10)
                                                  for _ in range(2)]}
        pump.cancel()
        return good, late, ended

    good, late, ended = asyncio.run(main())
    assert ended["direct"].result.ok and ended["direct"].state is ReadState.DELIVERED  # written when the hop began
    assert written == [("direct", dataplane._thread.ident)] and slot.completions.has("direct")
    assert not ended["direct-late"].result.ok and ended["direct-late"].state is ReadState.ENDED  # the loop's
    assert cluster.check(good.planned.request) == [] and _consumed(cluster, good)
    for holder in cluster.holders:
        with holder.lock:
            holder.holds.release(late.planned.request.remote_request_id)
    slot.completions.ack(slot.completions.last_seq)


def test_a_read_that_does_not_end_within_its_post_is_handed_over(plane):
    """No free check slot during the post: the data is in but unchecked, so the thread takes the read over
    and ends it once a slot is free (no completion from the post, exactly one from the thread)."""
    cluster, slot, dataplane, done = plane
    cluster.reset_decode()
    read = _read(cluster, slot, "handed-over", 3)
    checks = slot.executor.checks
    taken = [checks._free.pop() for _ in range(len(checks._free))]
    try:
        assert not dataplane.post_now(read) and dataplane.num_reads == 1
        assert read.state is ReadState.POSTED
        time.sleep(0.05)
        assert done.empty()  # still waiting for a check slot
    finally:
        checks._free.extend(taken)
    ended = done.get(timeout=10)
    assert ended is read and read.result.ok, read.result.error
    assert cluster.check(read.planned.request) == [] and _consumed(cluster, read)
    assert done.empty() and dataplane.num_reads == 0


def test_a_read_of_a_gone_remote_fails_at_once_on_either_path(plane):
    cluster, slot, dataplane, done = plane
    read = _read(cluster, slot, "gone", 4)
    real_remotes = slot.executor.connections.current
    slot.executor.connections.current = {}
    try:
        assert dataplane.post_now(read)
    finally:
        slot.executor.connections.current = real_remotes
    assert not read.result.ok and read.failure is ReadFailure.REMOTE_GONE and read.inflight is None
    assert sum(len(ids) for ids in read.result.invalid_block_ids) > 0 and dataplane.num_reads == 0
    with cluster.holders[0].lock:
        cluster.holders[0].holds.release(read.planned.request.remote_request_id)


def _polling_rounds(dataplane: DataPlane, monkeypatch) -> Callable[[float], int]:
    """Count the data-plane thread's polling rounds: the returned ``rounds_in(seconds)`` sleeps that long and
    says how many rounds began meanwhile (``_progress_notices`` runs once per slot in each round)."""
    rounds = []
    real = dataplane._progress_notices
    monkeypatch.setattr(dataplane, "_progress_notices", lambda s: rounds.append(time.perf_counter()) or real(s))

    def rounds_in(seconds: float) -> int:
        start = time.perf_counter()
        time.sleep(seconds)
        return sum(start <= t < start + seconds for t in rounds)

    return rounds_in


def test_an_introduced_reader_gets_the_holders_polling_for_its_handshake(plane, monkeypatch):
    """Idle, the thread polls every 0.5 s; a reader's introduction makes it poll every interval_s for
    READER_SETUP_S (the reader's probe over a new connection needs the holder's progress over TCP), and a
    reader rank the TP mapping never sends here gets none. (Where its agent cannot wake the thread: the
    same with wake sets is below.)"""
    cluster, slot, dataplane, done = plane
    monkeypatch.setattr(slot.agent, "_wake_fds", ())
    rounds_in = _polling_rounds(dataplane, monkeypatch)
    monkeypatch.setattr(holder_module, "READER_SETUP_S", 0.3)
    monkeypatch.setattr(slot.holder, "progress_wanted", {})
    monkeypatch.setattr(slot.holder, "readers", slot.holder.readers.copy())

    time.sleep(0.6)  # past the notice agents' safety net: idle
    assert rounds_in(0.3) <= 1
    slot.holder.introduce(("elsewhere", 1), Reader("elsewhere-notices", 2, 1), reads_here=False)
    dataplane.wake()
    assert rounds_in(0.3) <= 2
    slot.holder.introduce(("new-reader", 0), Reader("new-reader-notices", 1, 1))
    dataplane.wake()
    assert rounds_in(0.25) >= 25  # every 1 ms, on a loaded machine far fewer
    time.sleep(0.1)
    assert rounds_in(0.6) <= 2


def test_holding_polls_slowly_unless_a_readers_reads_wait_for_us(plane, monkeypatch):
    """While requests are held, the thread polls every notice_interval_s (only to count notices: readers
    over shared memory copy alone), and every interval_s while some reader's notice said its READs waited
    for our progress (UCX over TCP)."""
    cluster, slot, dataplane, done = plane
    monkeypatch.setattr(slot.agent, "_wake_fds", ())  # the timer's schedule (with wake sets: below)
    rounds_in = _polling_rounds(dataplane, monkeypatch)
    monkeypatch.setattr(dataplane, "notice_interval_s", 0.05)
    monkeypatch.setattr(slot.holder, "progress_wanted", {})  # the fixture's dict is back after the test

    slot.holder.hold("held-for-a-reader", (np.arange(2),), 60)
    try:
        dataplane.wake()
        time.sleep(dataplane_module.NOTICE_PROGRESS_S + 0.05)  # past the last notices' fast polls
        assert rounds_in(0.3) <= 8  # every 50 ms
        slot.holder.progress_wanted[("tcp-reader", 0)] = time.monotonic() + 60
        dataplane.wake()
        assert rounds_in(0.25) >= 25  # every 1 ms, on a loaded machine far fewer
        slot.holder.progress_wanted.clear()
        time.sleep(0.06)
        assert rounds_in(0.3) <= 8
    finally:
        with slot.holder.lock:
            slot.holder.holds.release("held-for-a-reader")


def test_an_agent_that_wakes_the_thread_gets_no_timer_polls_while_readers_may_need_it(plane, monkeypatch):
    """Issue #58: the slot's agent has socket sets (UCX over TCP keeps its sockets there), so a reader's
    bytes wake the thread: a reader that may need our progress costs no 1 ms polls. The control: the
    same agent without its sets is polled every interval_s (the two tests above)."""
    cluster, slot, dataplane, done = plane
    assert slot.agent.wake_fds, "the agent's TCP socket sets were found"
    rounds_in = _polling_rounds(dataplane, monkeypatch)
    monkeypatch.setattr(dataplane, "notice_interval_s", 0.05)
    monkeypatch.setattr(slot.holder, "progress_wanted", {})
    slot.holder.hold("held-for-a-woken-reader", (np.arange(2),), 60)
    try:
        slot.holder.progress_wanted[("tcp-reader", 0)] = time.monotonic() + 60
        dataplane.wake()
        time.sleep(dataplane_module.NOTICE_PROGRESS_S + 0.05)
        assert rounds_in(0.3) <= 10  # every 50 ms (notice_interval_s), not every 1 ms
        monkeypatch.setattr(slot.agent, "_wake_fds", ())  # the control, in the same sitting
        dataplane.wake()
        assert rounds_in(0.25) >= 25
    finally:
        slot.holder.progress_wanted.clear()
        with slot.holder.lock:
            slot.holder.holds.release("held-for-a-woken-reader")


def test_notices_sent_on_the_loop_get_the_idle_threads_progress_at_once(plane, monkeypatch):
    """A read that ends in post_now has its notices sent on the calling thread (send_notices, after the
    completion), whose one poll may not send them; the idle thread is woken to poll the notice agent, not IDLE_POLL_S later (a vLLM test's holder
    saw no CONSUMED after 0.3 s)."""
    cluster, slot, dataplane, done = plane
    monkeypatch.setattr(dataplane_module, "IDLE_POLL_S", 30.0)
    monkeypatch.setattr(dataplane_module, "INLINE_CHECK_WAIT_S", 5.0)
    dataplane.wake()  # its next idle sleep is 30 s
    time.sleep(0.1)  # past the wake-up's round (and any safety-net polls: NOTICE_PROGRESS_S)
    deadline = time.monotonic() + 5
    while not dataplane._idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataplane._idle
    polls = []
    notices = slot.executor.notices
    real = notices.poll_notifications
    monkeypatch.setattr(notices, "poll_notifications",
                        lambda: polls.append(threading.current_thread().name) or real())
    cluster.reset_decode()
    read = _read(cluster, slot, "woken", 41)
    assert dataplane.post_now(read) and read.result.ok
    dataplane.send_notices(read)
    deadline = time.monotonic() + 3
    while "kvxferd-dataplane" not in polls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "kvxferd-dataplane" in polls, polls
    assert _consumed(cluster, read)


def test_an_idle_thread_still_polls_the_notice_agents_long_after_their_last_notice(plane, monkeypatch):
    """A notice can outlast its window of fast polls (its connection still being set up, its holder busy or
    stopped): the idle rounds keep polling the notice agent, so it goes out late rather than never."""
    cluster, slot, dataplane, done = plane
    monkeypatch.setattr(dataplane_module, "IDLE_POLL_S", 0.05)
    dataplane.wake()
    time.sleep(dataplane_module.NOTICE_PROGRESS_S + 0.1)  # past the last notice's window of fast polls
    polls = []
    notices = slot.executor.notices
    real = notices.poll_notifications
    monkeypatch.setattr(notices, "poll_notifications",
                        lambda: polls.append(threading.current_thread().name) or real())
    time.sleep(0.5)
    assert polls.count("kvxferd-dataplane") >= 3, polls  # every 25-50 ms; none without the idle polls


def test_a_read_past_its_deadline_before_its_post_fails_with_nothing_posted(plane):
    """On either path: the engine was promised an answer by the deadline; posting now would only move
    bytes nobody waits for (under a backlog, this sheds them)."""
    cluster, slot, dataplane, done = plane
    for path, request_id in (("here", "late-here"), ("there", "late-there")):
        cluster.reset_decode()
        read = _read(cluster, slot, request_id, 40)
        read.deadline_s = read.received_s  # already passed
        if path == "here":
            assert dataplane.post_now(read)
            ended = read
        else:
            dataplane.submit(read)
            ended = done.get(timeout=10)
        assert ended is read and not ended.result.ok
        assert ended.failure is ReadFailure.DEADLINE and "before the read could be posted" in ended.result.error
        assert read.inflight is None and ended.post_s == 0  # nothing was posted
        assert sum(len(ids) for ids in ended.result.invalid_block_ids) == sum(
            len(ids) for ids in read.planned.request.local_block_ids)
        for holder in cluster.holders:  # what an engine does with a failed read: release
            with holder.lock:
                holder.holds.release(read.planned.request.remote_request_id)
    assert dataplane.num_reads == 0
