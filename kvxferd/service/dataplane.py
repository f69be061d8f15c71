"""The daemon's data-plane thread: every NIXL call on the hot path happens here.

One thread drives every registered engine's agent, so NIXL is never called
from the event loop on the hot path::

    event loop (gRPC)              data-plane thread
    ─────────────────              ─────────────────────────────────────────
    submit: validate, plan ──────► post (make_prepped_xfer + transfer per rank)
                                   poll states and notices of every agent:
                                     reader notice -> from the agent that reader introduced?
                                       no: dropped, counted; yes: hold table -> ack to the reader
                                     holder ack    -> the waiting read
    ReadPath.done(list) ◄───────── reads that ended this round (one hop per round, not per read):
    notify bus          ◄───────── transfer finished AND every rank read from acked "alive"
                                   hold CONSUMED / reader FAILED (also a list per round)

How often it wakes (measured in docs/benchmarks.md; an idle daemon costs nothing)::

    own reads in flight          poll, sleeping 20 µs doubling to READ_POLL_MAX_S
    holds a reader may notify    poll every HOLD_POLL_S (an ack within ~0.1 ms); Hold wakes it
    neither                      poll every IDLE_POLL_S (a stray notice still gets its "not
                                 alive" answer, UCX keeps progressing) until woken
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
from dataclasses import dataclass, field, replace

from kvxferd.errors import InvalidArgumentError, KvxferError
from kvxferd.plan.engine import PlannedRead
from kvxferd.plan.leases import HoldEnd
from kvxferd.plan.notifications import ReadAck, is_ack
from kvxferd.service.slots import EngineSlot
from kvxferd.xfer.agent import NixlError
from kvxferd.xfer.reads import POLL_MIN_S, InFlightRead, ReadFailure, ReadResult, RemoteEngine
from kvxferd.xfer.waker import Waker

log = logging.getLogger("kvxferd.dataplane")
READ_POLL_MAX_S = 100e-6  # longest sleep while this daemon's own reads are in flight
HOLD_POLL_S = 100e-6  # sleep while some engine holds requests a reader may notify about
IDLE_POLL_S = 0.5  # engines registered, nothing outstanding: a stray notice waits up to this long


@dataclass(eq=False)
class DaemonRead:
    """A submitted read from its post to its acks."""

    slot: EngineSlot
    remote: RemoteEngine
    planned: PlannedRead
    submitted_s: float  # perf_counter when the RPC arrived
    deadline_s: float  # perf_counter
    inflight: InFlightRead | None = None
    queued_s: float = 0.0  # handed to this thread
    posted_s: float = 0.0
    transferred_s: float = 0.0  # every rank's transfer ended
    transfer: ReadResult | None = None
    acks: dict[int, bool | None] = field(default_factory=dict)  # remote rank read -> holder alive?

    @property
    def request_id(self) -> str:
        return self.planned.request.request_id


@dataclass(frozen=True, eq=False)
class ReadDone:
    """A finished read as the engine will see it."""

    slot: EngineSlot
    result: ReadResult
    post_s: float  # submit -> every rank posted
    done_unix_s: float
    failure: ReadFailure  # NONE when ok
    plan_s: float = 0.0  # submit -> handed to the data-plane thread
    transfer_s: float = 0.0  # posted -> every transfer ended
    ack_s: float = 0.0  # transfers ended -> acks in


class DataPlane:
    """The thread; start with :meth:`start`, stop with :meth:`stop`."""

    def __init__(self, on_reads_done: Callable[[list[ReadDone]], None],
                 on_hold_events: Callable[[list[tuple[EngineSlot, str, HoldEnd]]], None], *,
                 interval_s: float = HOLD_POLL_S,
                 metrics=None) -> None:
        self._on_reads_done = on_reads_done
        self._finished: list[ReadDone] = []  # this round's, handed over together
        self._on_hold_events = on_hold_events
        self._hold_events: list[tuple[EngineSlot, str, HoldEnd]] = []  # this round's
        self._metrics = metrics
        self.interval_s = interval_s
        self._slots: list[EngineSlot] = []
        self._reads: list[DaemonRead] = []
        # (reader engine, holder agent, holder's request id) -> the read and the holder's rank
        self._awaiting: dict[tuple[str, str, str], tuple[DaemonRead, int]] = {}
        self._commands: collections.deque = collections.deque()
        self._wake = Waker()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxferd-dataplane", daemon=True)
        self._num_submitted = self._num_done = 0  # written by the loop / by this thread only

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
        """Reads queued or in flight (read from any thread: two single-writer counters, no iteration)."""
        return self._num_submitted - self._num_done

    def submit(self, read: DaemonRead) -> None:
        """Queue a planned read for posting (event-loop thread)."""
        self._num_submitted += 1
        read.queued_s = time.perf_counter()
        self._commands.append(("post", read))
        self._wake.set()

    def wake(self) -> None:
        """Something changed that needs faster polling (a new hold): any thread."""
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the data-plane thread (connect, close); returns its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append(("call", (fn, future)))
        self._wake.set()
        return future

    # ---- commands (data-plane thread) ---------------------------------------------
    def add_slot(self, slot: EngineSlot) -> None:
        self._slots.append(slot)
        slot.holder.counts.on_add = self._count_refused

    def _count_refused(self, kind: str) -> None:
        if self._metrics is None:
            return
        if kind == "foreign":
            self._metrics.notices_dropped.inc()
        elif kind == "stale":
            self._metrics.stale_reads.labels("holder").inc()

    def fail_reads(self, slot: EngineSlot, reason: str, remote_engine_id: str | None = None) -> None:
        """Abort a slot's reads (of one remote engine, or all) before their memory or lists go."""
        for read in list(self._reads):
            if read.slot is slot and remote_engine_id in (None, read.remote.plan.remote_engine_id):
                if read.transfer is None:
                    read.transfer = slot.executor.abort(read.inflight, reason)
                else:
                    read.transfer = _failed(read, read.transfer, reason, tuple(q for q, a in read.acks.items() if a is None))
                self._finish(read, ReadFailure.ABORTED)

    def remove_slot(self, slot: EngineSlot, reason: str) -> None:
        """Fail the slot's reads, disconnect its remotes and deregister its memory."""
        self.fail_reads(slot, reason)
        if slot in self._slots:
            self._slots.remove(slot)
        slot.executor.close()

    # ---- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        sleep_s = POLL_MIN_S
        while not self._stop.is_set():
            busy = self._run_commands()
            busy |= self._advance_reads()
            busy |= self._poll_notifications()
            self._flush_finished()
            if busy:
                sleep_s = POLL_MIN_S
            elif self._reads:
                sleep_s = min(sleep_s * 2, READ_POLL_MAX_S)
            elif any(len(slot.holds) for slot in self._slots):
                sleep_s = self.interval_s
            else:
                sleep_s = IDLE_POLL_S if self._slots else None
            self._wake.wait(sleep_s)

    def _run_commands(self) -> bool:
        busy = False
        while self._commands:
            kind, item = self._commands.popleft()
            busy = True
            if kind == "post":
                self._post(item)
                continue
            fn, future = item
            try:
                value = fn()
            except BaseException as err:  # handed to the caller
                self._flush_finished()
                future.set_exception(err)
            else:
                self._flush_finished()  # reads that call failed reach the loop before the caller goes on
                future.set_result(value)
        return busy

    def _flush_finished(self) -> None:
        if self._finished:
            finished, self._finished = self._finished, []
            self._on_reads_done(finished)
        if self._hold_events:
            events, self._hold_events = self._hold_events, []
            self._on_hold_events(events)

    def _post(self, read: DaemonRead) -> None:
        executor = read.slot.executor
        try:
            if not executor.is_current(read.remote):  # re-handshaked since planning: same layout, new lists
                read.remote = executor.remote(read.remote.plan.remote_engine_id)
                read.planned = read.remote.plan.plan_request(read.planned.request)
            read.inflight = executor.post_planned(read.remote, read.planned, read.submitted_s)
        except KvxferError as err:
            self._deliver(read, error_result(read, str(err)), ReadFailure.REMOTE_GONE)
            return
        read.posted_s = time.perf_counter()
        names = read.remote.agent_names
        for rank_read in read.planned.reads:
            q = rank_read.remote_rank
            read.acks[q] = None
            self._awaiting[(read.slot.engine_id, names[q], read.planned.request.remote_request_id)] = (read, q)
        self._reads.append(read)

    def _advance_reads(self) -> bool:
        busy = False
        now = time.perf_counter()
        for read in list(self._reads):
            if read.transfer is None:
                read.transfer = read.slot.executor.poll(read.inflight)
                if read.transfer is None and now >= read.deadline_s:
                    read.transfer = read.slot.executor.abort(read.inflight, "deadline: the transfer did not finish in time",
                                                             ReadFailure.DEADLINE)
                if read.transfer is None:
                    continue
                read.transferred_s = now
            busy |= self._settle(read, now)
        return busy

    def _settle(self, read: DaemonRead, now: float) -> bool:
        """Finish a read whose transfer ended once its acks are in; True when it finished."""
        if not read.transfer.ok:
            self._finish(read, read.transfer.failure or ReadFailure.TRANSFER)
            return True
        waiting = tuple(q for q, alive in read.acks.items() if alive is None)
        stale = tuple(q for q, alive in read.acks.items() if alive is False)
        if stale:
            read.transfer = _failed(read, read.transfer, "stale read: the hold had ended (lease expired or "
                                    "released) before the holder acknowledged the read", stale)
            self._finish(read, ReadFailure.STALE)
        elif not waiting:
            self._finish(read, ReadFailure.NONE)
        elif now >= read.deadline_s:
            read.transfer = _failed(read, read.transfer, "deadline: the holder did not acknowledge the read", waiting)
            self._finish(read, ReadFailure.DEADLINE)
        else:
            return False  # still waiting for an ack: not progress, keep backing off
        return True

    def _finish(self, read: DaemonRead, failure: ReadFailure) -> None:
        self._reads.remove(read)
        names = read.remote.agent_names
        for q in read.acks:
            self._awaiting.pop((read.slot.engine_id, names[q], read.planned.request.remote_request_id), None)
        self._deliver(read, read.transfer, failure)

    def _deliver(self, read: DaemonRead, result: ReadResult, failure: ReadFailure) -> None:
        self._num_done += 1
        now = time.perf_counter()
        post_s = read.posted_s - read.submitted_s if read.posted_s else 0.0
        result = replace(result, duration_s=now - read.submitted_s)  # includes the acks
        stages = {}
        if read.posted_s:
            stages["plan_s"] = read.queued_s - read.submitted_s
            if read.transferred_s:
                stages.update(transfer_s=read.transferred_s - read.posted_s, ack_s=now - read.transferred_s)
        self._finished.append(ReadDone(read.slot, result, post_s, time.time(), failure, **stages))

    # ---- notices and acks ------------------------------------------------------------
    def _poll_notifications(self) -> bool:
        busy = False
        for slot in self._slots:
            try:
                messages = slot.agent.new_messages()
            except NixlError as err:
                log.warning("polling notifications failed", extra={"engine_id": slot.engine_id, "error": str(err)})
                continue
            for sender, message in messages:
                busy = True
                if is_ack(message):
                    self._on_ack(slot, sender, message)
                else:
                    self._on_notice(slot, sender, message)
        return busy

    def _on_notice(self, slot: EngineSlot, sender: str, message: bytes) -> None:
        for kind, end in slot.holder.on_notice(sender, message):
            self._hold_events.append((slot, kind, end))

    def _on_ack(self, slot: EngineSlot, sender: str, message: bytes) -> None:
        try:
            ack = ReadAck.decode(message)
        except InvalidArgumentError:
            return  # not an ack of ours: a read waiting for one fails on its deadline
        entry = self._awaiting.get((ack.reader_engine_id, sender, ack.request_id))
        if entry is None or entry[0].slot is not slot:
            return  # the read ended already (deadline, abort), or a forged ack
        read, q = entry
        read.acks[q] = ack.alive


def error_result(read: DaemonRead, error: str) -> ReadResult:
    planned = read.planned
    everything = tuple(range(len(read.remote.agent_names)))
    return ReadResult(planned.request.request_id, read.remote.plan.remote_engine_id, False, 0, 0,
                      time.perf_counter() - read.submitted_s, planned.invalid_block_ids(everything), everything, error)


def _failed(read: DaemonRead, result: ReadResult, error: str, ranks: tuple[int, ...]) -> ReadResult:
    failed = tuple(sorted(set(result.failed_ranks) | set(ranks)))
    return replace(result, ok=False, failed_ranks=failed, error=error,
                   invalid_block_ids=read.planned.invalid_block_ids(failed),
                   num_bytes=sum(r.num_bytes for r in read.planned.reads if r.remote_rank not in failed),
                   duration_s=time.perf_counter() - read.submitted_s)

