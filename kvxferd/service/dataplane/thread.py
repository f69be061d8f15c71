"""The daemon's data-plane thread: it polls every agent, and posts every read but the small ones.

One thread drives every registered engine's agent. The event loop calls
NIXL on the hot path only to post a small read (``post_now``: host memory is
copied inside ``transfer()``, so such a read most often ends right there)::

    event loop (gRPC)              data-plane thread
    ─────────────────              ─────────────────────────────────────────
    submit: validate, plan ──────► post (make_prepped_xfer + transfer per rank); a batch's
                                   large read comes unplanned: planned here first
    (a small read: post_now posts
    it on the loop; ended there ─► its completion at once; else ─────► polled here)
                                   poll own reads: data ended -> board check READ
                                   poll notices of every agent (and the notice agents' progress):
                                     reader notice -> from the agent that reader introduced?
                                       no: dropped, counted; yes: hold table
    engine's reads socket ◄─────── an ok read's completion, written here (CompletionFeed.put_direct)
    ReadPath.done(list) ◄───────── reads that ended this round (one hop per round, not per read):
                                   transfer finished AND every rank's hold still on its board;
                                   the loop's bookkeeping, and the completions not written here;
                                   then the holders' notices (the engine does not wait for them)
    notify bus          ◄───────── hold CONSUMED / reader FAILED (also a list per round)

It sleeps on an eventfd (work from the loop) and on the socket sets of every
agent it drives (``NixlAgent.wake_fds``, :mod:`kvxferd.xfer.osutil.ucxwake`): a
peer's READ request, notice or reply wakes it, and that agent makes progress at
once. A reader that needs our progress (UCX over TCP) is then served without
polling; where an agent has no such set (or it is muted for firing with nothing
to do) the timers below do it, as they did before issue #58.

How often it wakes on its timer (measured in docs/benchmarks.md; an idle daemon costs nothing)::

    own reads in flight          poll, sleeping 20 µs doubling to READ_POLL_MAX_S (to SOCKET_READ_POLL_MAX_S
                                 while every reading slot's set woke us lately: its replies come over
                                 UCX's tcp sockets, which wake us when they arrive)
    a reader may need us, and    poll every ``interval_s`` (config poll_interval_s, 1 ms): UCX
    its agent cannot wake us
                                 over TCP serves a READ only while the holder makes progress; such
                                 a reader's notices say its READs waited, and a reader just
                                 introduced probes our board over a new connection
                                 (Holder.wants_progress)
    holds, no reader needs us    poll every ``notice_interval_s`` (config notice_poll_interval_s,
                                 10 ms): over shared memory a reader copies inside its post, and
                                 this only counts notices (how soon a hold ends CONSUMED). Measured:
                                 the 1 ms polls of four holders cost kvxferd demo 0.05-0.1 of its ratio
    notices sent lately          poll every NOTICE_POLL_S (10 ms) for 50 ms (a safety net: the
                                 executor makes progress right after sending; notices sent on
                                 the event loop wake an idle thread for it: notices_sent)
    neither                      poll every IDLE_POLL_S (UCX keeps progressing, the notice agents
                                 too: a notice stuck on a slow connection set-up) until woken
    no engine registered         block until woken

Holds are shared with the event loop (Hold, RenewLease, expiry) under the
slot's lock. Everything that crosses back to the loop goes through the
``on_reads_done`` and ``on_hold_events`` callbacks (a list per round: one
hop for everything that ended in it), which must be thread-safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.errors import KvxferError, PermissionDeniedError, UnavailableError
from kvxferd.plan.expectrecord import ExpectRecord, is_expectation
from kvxferd.plan.leases import HoldEnd
from kvxferd.service.engines.read import Read, ReadState
from kvxferd.service.dataplane.slotsets import SlotSets
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.xfer.admission import admit
from kvxferd.xfer.nixl.agent import NixlError
from kvxferd.xfer.holder import NoticeEvent
from kvxferd.xfer.osutil.osthreads import name_this_thread
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.osutil.waker import Waker

log = logging.getLogger("kvxferd.dataplane")
READ_POLL_MIN_S = 20e-6  # first sleep while this daemon's own reads are in flight; doubles up to:
READ_POLL_MAX_S = 100e-6  # longest sleep while this daemon's own reads are in flight
SOCKET_READ_POLL_MAX_S = 1e-3  # the same when their replies come over sockets that wake us (issue #58)
HOLD_POLL_S = 1e-3  # sleep while holding requests for a reader whose READs need our progress
NOTICE_HOLD_POLL_S = 1e-2  # sleep while holding requests whose readers copy alone (only their notices wait)
NOTICE_PROGRESS_S = 0.05  # how long a notice agent is polled after its last notice,
NOTICE_FLUSH_POLL_S = 0.001  # while a leaving engine's last notices go (remove_slot)
NOTICE_POLL_S = 0.01  # and how often (the executor polls it right after sending: this is a safety net)
IDLE_POLL_S = 0.5  # engines registered, nothing outstanding: a stray notice waits up to this long
# Push (issue #57): while an engine here expects writes, its completion waits for the writers' notices:
# poll for them this often (a wake-up every 100 us costs a few % of a core, only while pushes are pending).
EXPECT_POLL_S = 100e-6
MAX_WORKER_NOTICES = 8192  # notices of one slot's worker waiting for the thread, past which they are dropped
WOKEN_READ_POLL_S = 5e-3  # reads in flight that wake this thread when they end: how late a deadline is seen
INLINE_MAX_BYTES = 1 << 20  # reads up to this size are posted on the event loop (post_now)
INLINE_CHECK_WAIT_S = 50e-6  # how long post_now polls for board checks before handing a read over


@dataclass(frozen=True, eq=False)
class _Call:
    """A command for the thread: run ``fn`` there, its outcome on ``future`` (:meth:`DataPlane.call`)."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


class DataPlane:
    """The thread; start with :meth:`start`, stop with :meth:`stop`."""

    def __init__(self, on_reads_done: Callable[[list[Read]], None],
                 on_hold_events: Callable[[list[tuple[EngineSlot, HoldEnd]]], None], *,
                 interval_s: float = HOLD_POLL_S, notice_interval_s: float = NOTICE_HOLD_POLL_S,
                 metrics=None, on_expectations: Callable[[list], None] | None = None) -> None:
        """``on_expectations``: a round's push expectations from introduced readers, (slot, record, identity of
        the peer that introduced the reader) each."""
        self._on_reads_done = on_reads_done
        self._on_expectations = on_expectations
        self._expectations: list[tuple[EngineSlot, ExpectRecord, str]] = []  # this round's
        self._finished: list[Read] = []  # this round's ended reads, handed over together
        self._on_hold_events = on_hold_events
        self._hold_events: list[tuple[EngineSlot, HoldEnd]] = []  # this round's
        self._metrics = metrics
        self.interval_s, self.notice_interval_s = interval_s, notice_interval_s
        self._slots: list[EngineSlot] = []
        # id(slot) -> (its executor's num_notices_sent, when this thread saw it change, when its notice
        # agent was last polled): perf_counter. Counted, not timed by the sender: notices sent on the
        # event loop while this thread sleeps IDLE_POLL_S still get their polls once it wakes (a notice
        # on a new connection needs more than the sender's one poll: test_fuzz_rpcs lost CONSUMED so).
        self._notices_seen: dict[int, tuple[int, float, float]] = {}
        self._notices_active = False  # some notice agent was polled in the last polling round
        self._idle = False  # this thread sleeps IDLE_POLL_S (or until woken): notices_sent() wakes it
        self._notices_polled_s = 0.0  # perf_counter of the last polling round
        self._reads: list[Read] = []  # posted, owned by this thread until handed back ended
        self._commands: collections.deque[Read | _Call] = collections.deque()
        self._wake = Waker()
        self.sets = SlotSets()  # the socket sets of the slots' agents, and their mutes
        self._worker_notices_lock = threading.Lock()  # the two below: supervisors' threads and this one
        self._worker_notices: dict[int, int] = {}  # id(slot) -> its worker's notices waiting for this thread
        self._worker_notices_dropped: dict[int, int] = {}  # id(slot) -> dropped since this thread last looked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxferd-dataplane", daemon=True)
        # written by the loop / by this thread / by the loop (reads that ended within post_now) only
        self._num_submitted = self._num_done = self._num_done_now = 0

    # ---- API (any thread) -----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def num_reads(self) -> int:
        """Reads queued or in flight (read from any thread: single-writer counters, no iteration)."""
        return self._num_submitted - self._num_done - self._num_done_now

    def submit(self, read: Read) -> None:
        """Hand a read to this thread, which plans it if needed and posts it (event-loop thread)."""
        self._num_submitted += 1
        read.queued_s = time.perf_counter()
        self._commands.append(read)
        self._wake.set()

    def post_now(self, read: Read) -> bool:
        """Post a small read on the calling thread (the event loop): True when it ended within the post
        (host memory: NIXL copies inside ``transfer()``) and INLINE_CHECK_WAIT_S of polling for its board
        checks; else False, and it is this thread's from now on. Saves the hop here and back
        (docs/benchmarks.md).

        The caller keeps it to reads of at most INLINE_MAX_BYTES: the copy blocks the loop meanwhile.
        Everything happens under the executor's lock, which a re-handshake or a deregistration takes
        to fail the slot's reads and release their lists: a read handed over here is among them.
        """
        self._num_submitted += 1
        read.queued_s = time.perf_counter()
        executor = read.slot.executor
        with executor.lock:
            if self._start(read):
                inflight = read.inflight
                # A backend whose reads end elsewhere (a reader worker) never ends one within the post.
                wait_until_s = time.perf_counter() + (0.0 if executor.wakes_when_done else INLINE_CHECK_WAIT_S)
                while inflight.result is None and not inflight.data_in_flight and time.perf_counter() < wait_until_s:
                    executor.poll(inflight, notify=False)  # the data is in, its checks not yet: a few µs (bench floors)
                if inflight.result is None:
                    self._reads.append(read)  # list.append is atomic; this thread polls it from now on
                    self._wake.set()
                    return False
                read.end(inflight.result, inflight.result.failure)
        self._num_done_now += 1
        return True

    def send_notices(self, read: Read) -> None:
        """The holders' notices of a read that ended in :meth:`post_now` (event-loop thread), once its
        completion was handed on: the engine does not wait for the holders' bookkeeping."""
        if read.inflight is None:
            return
        read.slot.executor.send_notices(read.inflight)
        self.notices_sent()

    def notices_sent(self) -> None:
        """The calling thread sent notices (a read that ended in post_now, a probe's HELLO): they go out
        only while their agent makes progress, and the sender's one poll may not send them (a new
        connection, a busy machine). An idle thread would poll the notice agent only IDLE_POLL_S later,
        the holder's blocks held that long (a vLLM test saw no CONSUMED after 0.3 s): wake it. A thread
        already polling sees the new count within NOTICE_POLL_S, so most reads cost no wake-up."""
        if self._idle:
            self._wake.set()

    def wake(self) -> None:
        """Something changed that needs faster polling (a new hold): any thread."""
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the data-plane thread (connect, close); returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append(_Call(fn, future))
        self._wake.set()
        return future

    def take_notices(self, slot: EngineSlot, notices: list[tuple[str, bytes]]) -> None:
        """Notices a slot's data-plane worker received: counted on this thread like its own (its supervisor's
        thread calls this). Past MAX_WORKER_NOTICES of one slot waiting (a worker flooding the thread every
        engine shares) its notices are dropped, and counted as such on this thread."""
        with self._worker_notices_lock:
            waiting = self._worker_notices.get(id(slot), 0)
            if waiting + len(notices) > MAX_WORKER_NOTICES:
                self._worker_notices_dropped[id(slot)] = self._worker_notices_dropped.get(id(slot), 0) + len(notices)
                return
            self._worker_notices[id(slot)] = waiting + len(notices)
        self.call(lambda: self._count_worker_notices(slot, notices))

    def _count_worker_notices(self, slot: EngineSlot, notices: list[tuple[str, bytes]]) -> bool:
        with self._worker_notices_lock:
            self._worker_notices[id(slot)] -= len(notices)
            dropped = self._worker_notices_dropped.pop(id(slot), 0)
        for _ in range(dropped):
            slot.holder.counts.add(NoticeEvent.BAD)
        return self._count_notices(slot, notices)

    # ---- commands (data-plane thread) ---------------------------------------------
    def add_slot(self, slot: EngineSlot) -> None:
        self._slots.append(slot)
        slot.holder.counts.on_add = self._count_refused
        self.sets.rebuild(self._slots)

    def num_wake_sets(self) -> int:
        """Socket sets of the agents this thread drives (any thread)."""
        return len(self.sets)

    def _serve_woken(self, woken: list[int]) -> None:
        """Progress for the agents whose sockets woke this thread: their peers' READs go on now."""
        polled = False
        for fd in woken:
            owner = self.sets.owner(fd)
            if owner is None:
                continue
            slot, notices = owner
            if notices:
                slot.executor.progress_notices()
                continue
            if self._reads:  # replies to our reads woke us (SlotSets.socket_paced)
                self.sets.replies_woke(slot)
            if not polled:  # every agent's notices in one go (it polls each slot's agent)
                polled = True
                self._notices_polled_s = 0.0

    def _count_refused(self, event: NoticeEvent) -> None:
        if self._metrics is None:
            return
        if event.dropped:
            self._metrics.notices_dropped.labels(event.value).inc()
        elif event is NoticeEvent.LATE:
            self._metrics.late_notices.inc()
        elif event is NoticeEvent.WAITED:
            self._metrics.waited_notices.inc()

    def fail_reads(self, slot: EngineSlot, reason: str, remote_engine_id: str | None = None, *,
                   drain: bool = False) -> None:
        """Abort a slot's reads (of one remote engine, or all) before their memory or lists go; call with
        the slot's ``executor.lock`` held up to that release, so no read is posted on the loop meanwhile.
        ``drain``: the engine's memory stays (a new connection replaces the old): a read whose transfers
        UCX cannot stop ends once they did (ReadExecutor.abort), not at once."""
        for read in list(self._reads):
            if read.slot is slot and remote_engine_id in (None, read.remote_engine_id):
                result = slot.executor.abort(read.inflight, reason, drain=drain)
                if result is not None:
                    self._finish(read, result, ReadFailure.ABORTED)

    def remove_slot(self, slot: EngineSlot, reason: str) -> None:
        """Fail the slot's reads, let its last notices go, disconnect its remotes and deregister its memory."""
        with slot.executor.lock:
            self.fail_reads(slot, reason)
            self._flush_notices(slot)
            if slot in self._slots:
                self._slots.remove(slot)
                self.sets.rebuild(self._slots)  # before its agents close: their fds may be reused
            self._notices_seen.pop(id(slot), None)
            slot.holder.close()
            if slot.push_executor is not None:
                slot.push_executor.close()
            slot.executor.close()

    def _flush_notices(self, slot: EngineSlot) -> None:
        """Poll the slot's notice agent for what is left of NOTICE_PROGRESS_S after its last notice (all of it when
        this thread has not seen that notice yet): UCX sends a
        notice on only while its agent makes progress, and an engine that deregistered right after its read's
        completion had the CONSUMED notice die with the agent (the holder then kept the hold to its lease, and
        since issue #60 a leaving holder waits for it)."""
        sent = slot.executor.num_notices_sent
        if not sent:
            return
        seen = self._notices_seen.get(id(slot))  # (notices sent so far, when that count was first seen, ...)
        last_notice_s = seen[1] if seen is not None and seen[0] == sent else time.perf_counter()
        until_s = last_notice_s + NOTICE_PROGRESS_S
        while time.perf_counter() < until_s:
            try:
                slot.executor.progress_notices()
            except KvxferError:
                return
            time.sleep(NOTICE_FLUSH_POLL_S)

    # ---- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        name_this_thread()
        sleep_s = READ_POLL_MIN_S
        woken: list[int] = []
        while not self._stop.is_set():
            self._serve_woken(woken)
            busy = self._run_commands()
            busy |= self._advance_reads()
            busy |= self._poll_notifications()
            self._flush_finished()
            self._pace_workers()
            if busy:
                sleep_s = READ_POLL_MIN_S
            elif self._reads and not all(read.slot.executor.wakes_when_done for read in self._reads):
                sleep_s = min(sleep_s * 2, SOCKET_READ_POLL_MAX_S if self.sets.socket_paced(read.slot for read in self._reads)
                              else READ_POLL_MAX_S)
            elif self._reads:  # each ends on another thread, which wakes this one: only deadlines to watch
                sleep_s = WOKEN_READ_POLL_S
                if self._needs_timer_progress():
                    sleep_s = min(WOKEN_READ_POLL_S, self.interval_s)
            # A slot a data-plane worker serves is polled there, paced by _pace_workers; its notices come
            # as commands (take_notices), which wake this thread: its holds need no polling here.
            elif self._needs_timer_progress():
                sleep_s = self.interval_s
            elif any(slot.served is None and len(slot.holds) for slot in self._slots):
                sleep_s = max(self.interval_s, self.notice_interval_s)
            elif self._notices_active:
                sleep_s = max(self.interval_s, NOTICE_POLL_S)
            else:
                # Marked idle before looking at the counts, and notices_sent() counts before it looks at
                # the mark: a notice sent meanwhile is either seen here or wakes us.
                self._idle = True
                sleep_s = self.interval_s if self._notices_unseen() else IDLE_POLL_S if self._slots else None
            if self._pushes_pending():
                sleep_s = EXPECT_POLL_S if sleep_s is None else min(sleep_s, EXPECT_POLL_S)
                self._idle = False
            self.sets.wake_sets.after_round(woken)
            if self.sets.wake_sets.any_muted():  # its agent has traffic: polled on the short timer while muted
                sleep_s = self.interval_s if sleep_s is None else min(sleep_s, self.interval_s)
                self._idle = False
            woken = self._sleep(sleep_s)
            self._idle = False

    def _sleep(self, sleep_s: float | None) -> list[int]:
        """Wait up to ``sleep_s`` for work or a set; a set whose agent only serves peers (a READ of our
        memory, a notice) is served here and the wait goes on, without a full round: over TCP a holder
        is woken four to five times per read, and a round costs several times the agent's progress."""
        until_s = None if sleep_s is None else time.perf_counter() + sleep_s
        while True:
            woken = self._wake.wait_any(sleep_s, self.sets.to_wait_on({id(read.slot) for read in self._reads},
                                                                        self._notices_active))
            if not woken or not self._serve_peers(woken):
                return woken
            self.sets.wake_sets.after_round(woken)
            if until_s is not None:
                sleep_s = until_s - time.perf_counter()
                if sleep_s <= 0:
                    return []

    def _serve_peers(self, woken: list[int]) -> bool:
        """Progress for the slot agents in ``woken`` when nothing else waits for a round (no command, no read
        of ours in flight, no notice agent among them): their notices counted, hold events handed on. False:
        the caller runs a full round instead."""
        if self._commands or self._reads:
            return False
        slots = []
        for fd in woken:
            owner = self.sets.owner(fd)
            if owner is None or owner[1]:
                return False
            if owner[0] not in slots:
                slots.append(owner[0])
        for slot in slots:
            self._poll_slot(slot)
        self._flush_finished()
        return True

    def _needs_timer_progress(self) -> bool:
        """A reader may need a slot's progress (Holder.wants_progress) and its agent cannot wake us (a set
        muted: polled every interval_s meanwhile, see _run)."""
        return any(slot.served is None and slot.holder.wants_progress() and not self.sets.wakes_for(slot)
                   for slot in self._slots)

    def _pushes_pending(self) -> bool:
        """Push (issue #57): a decode rank here expects writers' notices, or a prefill rank holds a push whose
        expectation has not come yet (for ``PUSH_AWAIT_S`` at most). Loop-side fields: only their truth and a
        float are read here."""
        return any(slot.expected or (slot.awaited and time.monotonic() < slot.awaited_until_s)
                   for slot in self._slots)

    def _pace_workers(self) -> None:
        """Tell each data-plane worker how often its agent must make progress, by the rules this thread
        polls its own agents by (the module doc); sent only when it changes."""
        for slot in self._slots:
            if slot.served is not None:
                slot.served.pace(self.interval_s if slot.holder.wants_progress() else
                                 max(self.interval_s, self.notice_interval_s) if len(slot.holds) else IDLE_POLL_S)

    def _run_commands(self) -> bool:
        busy = False
        while self._commands:
            command = self._commands.popleft()
            busy = True
            if isinstance(command, Read):
                if self._start(command):
                    self._reads.append(command)
                else:
                    self._deliver(command)
                continue
            try:
                value = command.fn()
            except BaseException as err:  # handed to the caller
                self._flush_finished()
                command.future.set_exception(err)
            else:
                self._flush_finished()  # reads that call failed reach the loop before the caller goes on
                command.future.set_result(value)
        return busy

    def _flush_finished(self) -> None:
        if self._finished:
            finished, self._finished = self._finished, []
            for read in finished:  # before the hop to the loop, which they no longer wait for
                read.complete(queue=False)
            self._on_reads_done(finished)
            for read in finished:  # after the hand-over: the completions do not wait for the notices
                if read.inflight is not None:
                    read.slot.executor.send_notices(read.inflight)
        if self._hold_events:
            events, self._hold_events = self._hold_events, []
            self._on_hold_events(events)
        if self._expectations:
            records, self._expectations = self._expectations, []
            self._on_expectations(records)

    @staticmethod
    def _start(read: Read) -> bool:
        """Admit a read handed over unplanned (or unsealed), then post it on the engine's current link
        (either thread); False when it ended instead, with nothing posted. Bad ids and capabilities that
        do not seal its hold are refused (``read.refusal``) before any I/O. A read whose deadline passed
        before it could be posted fails as DEADLINE (the engine was promised an answer by then; under a
        backlog this sheds what nobody waits for any more); a remote that is gone, REMOTE_GONE."""
        if read.admitted is None or read.admitted.planned is None:
            try:
                read.admitted = admit(read.remote, read.request, read.admitted)
            except KvxferError as err:
                read.end_unposted(str(err), ReadFailure.REFUSED, refusal=err)
                return False
            read.queued_s = time.perf_counter()  # the plan stage ends here, as on the loop
        if time.perf_counter() >= read.deadline_s:
            read.end_unposted("deadline: it passed before the read could be posted", ReadFailure.DEADLINE)
            return False
        try:
            read.inflight = read.slot.executor.post(read.admitted, read.received_s, notify=False,
                                                    deadline_in_s=read.deadline_s - time.perf_counter())
        except (PermissionDeniedError, UnavailableError) as err:  # admitted again on a new link: not sealed
            # by its holders, or (digests) not checkable there: refused, nothing posted; the link is fine
            read.end_unposted(str(err), ReadFailure.REFUSED, refusal=err)
            return False
        except KvxferError as err:
            read.end_unposted(str(err), ReadFailure.REMOTE_GONE)
            return False
        read.admitted = read.inflight.admitted  # the link it runs on (a re-handshake replaces it)
        read.remote = read.admitted.remote
        read.posted_s = read.inflight.posted_s  # before the first poll, which may see the transfer end
        read.state = ReadState.POSTED
        return True

    def _advance_reads(self) -> bool:
        busy = False
        now = time.perf_counter()
        for read in list(self._reads):
            step = read.inflight.step
            result = read.slot.executor.poll(read.inflight, notify=False)
            busy |= read.inflight.step != step  # a rank's data came in: its check is posted, poll again soon
            if result is None and now >= read.deadline_s and read.inflight.drain is None:
                result = read.slot.executor.abort(read.inflight, "deadline: the transfer or its board check did "
                                                  "not end in time", ReadFailure.DEADLINE)
            if result is not None:
                self._finish(read, result, result.failure)
                busy = True
        return busy

    def _finish(self, read: Read, result, failure: ReadFailure) -> None:
        if result.unsettled and self._metrics is not None:
            self._metrics.unsettled_reads.inc()
        self._reads.remove(read)
        read.end(result, failure)
        self._deliver(read)

    def _deliver(self, read: Read) -> None:
        """A read ended on this thread: handed to the loop with the round's others."""
        self._num_done += 1
        self._finished.append(read)

    # ---- notices ----------------------------------------------------------------------
    def _poll_notifications(self) -> bool:
        """Every agent's notices, at most every ``interval_s`` (rounds come every 20-100 µs while this
        daemon's own reads run; nobody waits for a notice, so polling faster only costs CPU)."""
        now = time.perf_counter()
        every_s = EXPECT_POLL_S if self._pushes_pending() else self.interval_s
        if now - self._notices_polled_s < every_s:
            return False
        self._notices_polled_s = now
        busy = self._notices_active = False
        for slot in self._slots:
            busy |= self._poll_slot(slot, notice_agent=True)
        return busy

    def _poll_slot(self, slot: EngineSlot, *, notice_agent: bool = False) -> bool:
        """Progress for a slot's agent (and, ``notice_agent``, its notice agent's safety net); its notices
        counted. True when some came."""
        try:
            messages = slot.agent.new_messages()
            if notice_agent:
                self._progress_notices(slot)
        except NixlError as err:
            log.warning("polling notifications failed", extra={"engine_id": slot.engine_id, "error": str(err)})
            return False
        return self._count_notices(slot, messages)

    def _count_notices(self, slot: EngineSlot, messages: list[tuple[str, bytes]]) -> bool:
        """Hand each notice to the slot's holder; its hold events go out with this round's."""
        if slot not in self._slots:
            return False  # deregistered meanwhile: its holds ended already
        for sender, message in messages:
            if is_expectation(message):  # a push's (issue #57): to the event loop, from its introduced agent only
                taken = slot.holder.expectation(sender, message)
                if taken is not None and self._on_expectations is not None:
                    self._expectations.append((slot, *taken))
                continue
            for end in slot.holder.on_notice(sender, message):
                self._hold_events.append((slot, end))
        return bool(messages)

    def _notices_unseen(self) -> bool:
        """Some executor sent notices since this thread last counted them."""
        return any(slot.executor.num_notices_sent != self._notices_seen.get(id(slot), (-1,))[0]
                   for slot in self._slots)

    def _progress_notices(self, slot: EngineSlot) -> None:
        """Poll a slot's notice agent every NOTICE_POLL_S for NOTICE_PROGRESS_S after its last notice: it
        receives nothing, but UCX sends a notice on only while its agent makes progress. The executor
        polls it right after sending; this is the safety net (an idle one costs nothing)."""
        sent, now = slot.executor.num_notices_sent, time.perf_counter()
        seen = self._notices_seen.get(id(slot))
        if seen is None or seen[0] != sent:
            self._notices_seen[id(slot)] = seen = (sent, now, seen[2] if seen else 0.0)
        if now - seen[1] < NOTICE_PROGRESS_S:
            self._notices_active = True
            if now - seen[2] >= NOTICE_POLL_S:
                self._notices_seen[id(slot)] = (sent, seen[1], now)
                slot.executor.progress_notices()
        elif now - seen[2] >= IDLE_POLL_S / 2:
            # Long after the last notice, still on every idle round: a notice whose connection took longer
            # than the window to set up (its holder busy or stopped) would otherwise wait for the next
            # notice of this agent, maybe forever, and its hold would end EXPIRED instead of CONSUMED.
            self._notices_seen[id(slot)] = (sent, seen[1], now)
            slot.executor.progress_notices()
