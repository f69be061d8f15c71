"""Push, prefill side (issue #57): write a held transfer into the blocks decode ranks expect.

::

    a reader's handshake (GetEngineInfo)    with its rank as a push target (its engine info, checked as a
      connected once per target agent        handshake's): the writer's lists prepared now
    an expectation (NIXL notification       from the agent introduced for that decode rank only: its block
      to this rank's agent)                  ids, the expectation's capability, a deadline; kept until this
                                             engine holds the transfer (or the deadline)
    this engine's Hold of the transfer  ─┐
    an Expect for a transfer held already ┴─► plan (the decode rank's read plan, this rank's part) and post:
                                             the decode board checked, WRITE, checked again (xfer/pushes.py)
    the write ended                          the writer's notice to the decode rank (ok or failed); this
                                             engine's own hold counts that decode rank as read, so it ends
                                             CONSUMED (bus) once every decode rank it feeds was written

Nothing is written without this engine's live hold (its block ids) and the
decode rank's expectation on its board; the decode block ids come from the
decode rank's introduced agent (an authenticated peer introduced it), never
from an engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError, ResourceExhaustedError
from kvxferd.plan.engine import expected_readers
from kvxferd.plan.expectrecord import ExpectRecord
from kvxferd.plan.capability import push_key_opens
from kvxferd.plan.leases import FAILED, HoldEnd, LiveHold
from kvxferd.plan.notifications import ReadNotice
from kvxferd.plan.push import PlannedPush, PushRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.wire.messages import check_id
from kvxferd.wire.peerinfo import decode_info
from kvxferd.wire.samehost import info_without_shares
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import agent_name_of
from kvxferd.xfer.pushes import PushTarget
from kvxferd.xfer.records import InFlightRead, ReadResult

if TYPE_CHECKING:
    from kvxferd.service.reads.path import ReadPathParts

log = logging.getLogger("kvxferd.push")

POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # a posted push is polled with growing sleeps
# A closing engine's last notices: its agent progressed for this long, POLL_MAX_S apart (NIXL says nothing of
# a notification's delivery; 20 ms of it lost them under a loaded CI run, so a deregistration with pushes
# waiting takes this much longer)
FLUSH_S = 0.5
WARM_UP_S = 5.0  # a new connection's first READ may take this long (then the first push pays the rest)


@dataclass(eq=False)
class Expectation:
    """What one decode rank expects of this prefill rank for one transfer."""

    transfer_id: str
    owner: str  # the peer identity that introduced the decode rank (and named its push target)
    target_engine_id: str
    target_rank: int
    target_tp_size: int
    target_block_ids: tuple
    num_tokens: int | None
    capability: bytes
    push_key: bytes  # opens the prefill hold (its digest), or nothing is written
    deadline_s: float  # perf_counter: no write is posted after it
    connection: PushTarget
    started: bool = False
    hold_capability: bytes = b""  # of the prefill hold it was started on: a later hold of the id is another
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # A push written layer by layer: the planned push (by layer), the layers written per group so far and
    # their bytes; ``inflight`` while a stage is posted (None: waiting for more layers to be final).
    staged: PlannedPush | None = field(default=None, repr=False)
    layers_written: tuple[int, ...] = ()
    num_bytes_written: int = 0
    inflight: InFlightRead | None = field(default=None, repr=False)

    @property
    def awaits_layers(self) -> bool:
        """Written layer by layer, no stage in flight: waiting for more layers to be final."""
        return self.staged is not None and self.inflight is None

    @property
    def key(self) -> tuple[str, str, int]:
        """As its connection is keyed (:attr:`PushExecutor.targets`)."""
        return self.owner, self.target_engine_id, self.target_rank


class WritePath:
    """The expectations of this daemon's engine ranks, written once their engine holds the transfer."""

    def __init__(self, daemon: "ReadPathParts") -> None:
        self.daemon = daemon
        self.num_written = 0  # pushes whose write ended ok
        self._connecting: dict[tuple, asyncio.Task] = {}  # (id(slot), owner, target engine, rank) -> connecting

    def check_target(self, slot: EngineSlot, request: pb.EngineInfoRequest):
        """The push target a reader's handshake names (``EngineInfoRequest.reader_target``), decoded; None when
        there is none or this daemon does not push to it (``push_targets`` off, a worker serves the rank, a
        target whose layout cannot be written: logged, its pushes fail). A target that is not the very reader
        being introduced (engine, rank, TP size) is refused: one reader cannot name another's memory."""
        if not request.HasField("reader_target") or slot.pusher is None or not self.daemon.config.push_targets:
            return None
        try:
            info = decode_info(request.reader_target, slot.cache)
        except KvxferError as err:
            log.warning("a reader's push target was refused: its pushes will fail", extra={
                "engine_id": slot.engine_id, "error": str(err)})
            return None
        target = info.cache
        if (target.engine_id, target.tp_rank, target.tp_size) != (
                request.reader_engine_id, request.reader_tp_rank, request.reader_tp_size):
            raise InvalidArgumentError("reader_target", f"names rank {target.tp_rank}/{target.tp_size} of "
                                                        f"{target.engine_id!r}, not the reader being introduced "
                                                        f"({request.reader_tp_rank}/{request.reader_tp_size} of "
                                                        f"{request.reader_engine_id!r})")
        return info

    def connect_target(self, slot: EngineSlot, info, owner: str, *, same_host: bool = False) -> None:
        """An introduced reader's rank (:meth:`check_target`) as ``owner``'s push target: connected in the
        background (UCX's set-up of a new connection takes up to a second; the reader's handshake does not wait
        for it), not on its first push. A target that cannot be connected is logged; its pushes fail.
        ``same_host``: the reader proved it shares this host: the shared memory its target names is mapped
        (``same_host_writes``); else whatever it names is dropped here."""
        if not (same_host and self.daemon.config.same_host_writes):
            info = info_without_shares(info)
        key = (id(slot), owner, info.cache.engine_id, info.cache.tp_rank)
        self._connecting[key] = self.daemon.spawn(self._connect(slot, info, owner, key))

    def forget_targets(self, slot: EngineSlot, readers) -> None:
        """Readers whose introduction ended (``(identity, engine id, rank)`` each, evicted to make room): their
        push connections go too, so connections are bounded as introduced readers are."""
        pusher = slot.pusher
        if pusher is not None and readers:  # on the data-plane thread, as connections are made
            self.daemon.dataplane.call(lambda: [pusher.disconnect(tuple(key)) for key in readers])

    async def _connect(self, slot: EngineSlot, info, owner: str, key) -> None:
        try:
            await self._connection(slot, info, owner)
        except KvxferError as err:
            log.warning("a reader's push target was not connected: its pushes will fail", extra={
                "engine_id": slot.engine_id, "error": str(err)})
        finally:
            if self._connecting.get(key) is asyncio.current_task():
                del self._connecting[key]

    def expect_records(self, records: list[tuple[EngineSlot, ExpectRecord, str]]) -> None:
        """A data-plane round's expectations, each from the agent introduced for its decode rank, with the
        identity that introduced it (event loop); one whose target is still being connected is taken once it is.
        A refused one is told to its decode rank at once (when it is connected), nothing written."""
        for slot, record, owner in records:
            if slot.closing:
                continue
            key = (owner, record.reader_engine_id, record.reader_rank)
            connecting = self._connecting.get((id(slot), *key))
            if connecting is not None:
                connecting.add_done_callback(
                    lambda _, slot=slot, record=record, owner=owner: self.expect_records([(slot, record, owner)]))
                continue
            try:
                self._expect(slot, record, owner)
            except KvxferError as err:
                connection = None if slot.pusher is None else slot.pusher.targets.get(key)
                if connection is not None and record.reader_rank not in connection.plans:
                    connection = None
                self._refuse(slot, connection, record.reader_engine_id, record.reader_rank, record.transfer_id,
                             record.capability, str(err))

    def _expect(self, slot: EngineSlot, record: ExpectRecord, owner: str) -> None:
        """Keep (and, if the transfer is held already, start) one decode rank's expectation."""
        config = self.daemon.config
        check_id(record.transfer_id, "expectation.transfer_id")
        deadline_s = min(record.deadline_s, config.max_deadline_s)
        pusher = slot.pusher
        key = (owner, record.reader_engine_id, record.reader_rank)
        connection = None if pusher is None else pusher.targets.get(key)
        if connection is None:
            raise NotFoundError("expectation", f"rank {record.reader_rank} of {record.reader_engine_id!r} is not "
                                               "connected as a push target (no handshake named it, or this rank "
                                               "holds nothing it needs)")
        plan = connection.plans[record.reader_rank]
        if len(record.block_ids) != len(plan.target.groups):
            raise InvalidArgumentError("expectation.block_ids", f"{len(record.block_ids)} groups, the target has "
                                                                f"{len(plan.target.groups)}")
        counts = slot.num_expectations_by_owner
        if sum(counts.values()) >= config.max_holds_per_engine:  # (a sum over reader identities, not expectations)
            raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} keeps "
                                                                 f"{config.max_holds_per_engine} expectations already")
        if counts.get(owner, 0) >= config.max_expectations_per_reader:
            raise ResourceExhaustedError("max_expectations_per_reader", f"engine {slot.engine_id!r} keeps "
                                         f"{config.max_expectations_per_reader} expectations of this reader already")
        expectation = Expectation(record.transfer_id, owner, record.reader_engine_id, record.reader_rank,
                                  plan.target.tp_size, record.block_ids, record.num_tokens, record.capability,
                                  record.push_key, time.perf_counter() + deadline_s, connection)
        waiting = slot.expectations.setdefault(record.transfer_id, {})
        earlier = waiting.get(expectation.key)
        if earlier is not None:  # one expectation per transfer and decode rank: a second is not taken
            raise InvalidArgumentError("expectation.transfer_id", f"rank {record.reader_rank} of "
                                                                  f"{record.reader_engine_id!r} expects "
                                                                  f"{record.transfer_id!r} already")
        waiting[expectation.key] = expectation
        counts[owner] = counts.get(owner, 0) + 1
        expectation.timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, slot, expectation)
        self.on_hold(slot, record.transfer_id)

    async def _connection(self, slot: EngineSlot, info, owner: str) -> PushTarget | None:
        """``owner``'s push connection to the target rank, made once per target agent (again when it
        restarted)."""
        pusher, target = slot.pusher, info.cache
        current = pusher.targets.get((owner, target.engine_id, target.tp_rank))
        if current is not None and current.agent_names.get(target.tp_rank) == _agent_name(info.agent_metadata):
            return current
        same_host = _names_memory(target)
        connection = await asyncio.wrap_future(self.daemon.dataplane.call(
            lambda: pusher.connect(target, info.agent_metadata, info.board, owner, same_host=same_host)))
        if connection is not None and same_host:  # how its pushes go, and why not by copies where they do not
            log.info("a push target on this host", extra={
                "engine_id": slot.engine_id, "reader": f"{target.engine_id}/{target.tp_rank}",
                "writes": "copied" if connection.host_ranks else f"over NIXL: {connection.host_error}",
                "board": "mapped" if connection.host_ranks and not connection.board_error
                         else f"checked over NIXL: {connection.board_error or '-'}"})
        if connection is not None:  # UCX's set-up of the new connection, paid here, not by the first push
            check, sleep_s, until_s = pusher.start_warm_up(connection), POLL_MIN_S, time.perf_counter() + WARM_UP_S
            while not pusher.warm_up_done(check, give_up=time.perf_counter() >= until_s):
                await asyncio.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, POLL_MAX_S)
        return connection

    def on_hold(self, slot: EngineSlot, transfer_id: str) -> None:
        """This engine holds ``transfer_id`` now (or was asked again): start every expectation waiting for it."""
        waiting = slot.expectations.get(transfer_id)
        if not waiting:
            return
        with slot.lock:
            held = slot.holds.lookup(transfer_id, time.monotonic())
        for expectation in list(waiting.values()):
            if not expectation.started:
                if held is not None:  # (else not held yet: the engine's Hold starts it)
                    self._start(slot, expectation, held)
            elif expectation.awaits_layers:
                if held is None or held.capability != expectation.hold_capability:
                    self._abandon(slot, expectation)  # its hold ended (released, or held anew on other blocks)
                else:
                    self._next_stage(slot, expectation, held)  # FinalLayers: more layers to write

    def _start(self, slot: EngineSlot, expectation: Expectation, held: LiveHold) -> None:
        expectation.started, expectation.hold_capability = True, held.capability
        slot.awaited.discard(expectation.transfer_id)
        if expectation.timer is not None and held.layers_final is None:
            expectation.timer.cancel()  # staged: it stays, to end a push whose layers never all became final
        if not push_key_opens(expectation.push_key, held.push_digest):
            # not this hold's key (or a hold for reads only): the hold untouched (it is not this reader's to end)
            self._forget(slot, expectation)
            self._refuse(slot, expectation.connection, expectation.target_engine_id, expectation.target_rank,
                         expectation.transfer_id, expectation.capability, "its push key does not open the hold")
            return
        pusher = slot.pusher
        push = PushRequest(expectation.transfer_id, expectation.target_block_ids, held.block_ids,
                           expectation.capability, expectation.num_tokens)
        try:
            if pusher.targets.get(expectation.key) is not expectation.connection:
                raise NotFoundError("expectation", "the connection to the target rank was replaced (it restarted): "
                                                   "its new agent expects anew")
            if held.layers_final is not None:
                if not expectation.connection.stageable:
                    raise InvalidArgumentError("layers_final", "this pair's layouts cannot be split layer by layer: "
                                                               "hold it with every layer final")
                if slot.cache.layer_counts != expectation.connection.plans[expectation.target_rank].target.layer_counts:
                    raise InvalidArgumentError("layers_final", "the two engines count their layers differently: "
                                                               "a push cannot go layer by layer")
                expectation.staged = pusher.plan(expectation.connection.by_layer(), expectation.target_rank, push)
                expectation.layers_written = (0,) * len(held.layers_final)
            else:
                planned = pusher.plan(expectation.connection, expectation.target_rank, push)
        except KvxferError as err:  # ids that do not pair, a replaced target: the decode rank is told, nothing written
            self._finish(slot, expectation, None, held, f"push refused: {err}")
            return
        if expectation.staged is not None:
            self._next_stage(slot, expectation, held)
            return
        inflight = pusher.post(expectation.connection, planned)
        if pusher.poll(inflight) is not None:
            self._finish(slot, expectation, inflight, held)
        else:
            self._wait_for(slot, expectation, inflight, held)

    def _next_stage(self, slot: EngineSlot, expectation: Expectation, held: LiveHold) -> None:
        """Post the layers final since the last stage (all that remain once the hold is final); a stage with
        nothing to write waits for more, except the last (posted empty: its notice ends the push). Between
        stages the deadline may pass and the connection be replaced: the push fails then, as a whole write."""
        pusher = slot.pusher
        if time.perf_counter() >= expectation.deadline_s:
            self._finish(slot, expectation, None, held, "deadline: its last layers were not written in time")
            return
        if pusher.targets.get(expectation.key) is not expectation.connection:
            self._finish(slot, expectation, None, held, "the connection to the target rank was replaced")
            return
        planned, last = expectation.staged, held.layers_final is None
        final = tuple(planned.plan.target.layer_counts if last else held.layers_final)
        stage = planned.stage(expectation.layers_written, final)
        if stage is None and not last:
            expectation.layers_written = final
            return
        try:
            inflight = pusher.post(expectation.connection.by_layer(), planned, write=stage, stage=True)
        except KvxferError as err:
            self._finish(slot, expectation, None, held, f"a stage could not be posted: {err}")
            return
        expectation.layers_written, expectation.inflight = final, inflight
        self.daemon.metrics.push_stages.inc()
        if pusher.poll(inflight) is not None:
            self._stage_done(slot, expectation, inflight, held)
        else:
            self._wait_for(slot, expectation, inflight, held)

    def _stage_done(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead, held: LiveHold) -> None:
        """A stage ended: the push ends with a failed one or the last; else the next goes when layers are final."""
        last = expectation.layers_written == expectation.staged.plan.target.layer_counts
        if not inflight.result.ok or last:
            self._finish(slot, expectation, inflight, held)
            return
        self._count_copies(inflight)
        expectation.num_bytes_written += inflight.result.num_bytes
        expectation.inflight = None
        now_held = self._same_hold(slot, expectation)
        if now_held is None:
            self._finish(slot, expectation, None, held, "the prefill hold ended before its last layer was written")
        elif now_held.layers_final != held.layers_final or time.perf_counter() >= expectation.deadline_s:
            self._next_stage(slot, expectation, now_held)  # (past the deadline: fails there)

    @staticmethod
    def _same_hold(slot: EngineSlot, expectation: Expectation) -> LiveHold | None:
        """The prefill hold the expectation was started on, if it is still held (not a later hold of the id)."""
        with slot.lock:
            held = slot.holds.lookup(expectation.transfer_id, time.monotonic())
        return held if held is not None and held.capability == expectation.hold_capability else None

    def _wait_for(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead, held) -> None:
        """Wait for a posted write to end in the background (``slot.writing`` keeps it until then)."""
        task = self.daemon.spawn(self._wait(slot, expectation, inflight, held))
        slot.writing[inflight] = task
        task.add_done_callback(lambda _: slot.writing.pop(inflight, None))

    async def _wait(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead, held) -> None:
        pusher, sleep_s = slot.pusher, POLL_MIN_S
        while pusher.poll(inflight) is None:
            if time.perf_counter() >= expectation.deadline_s and inflight.drain is None:
                pusher.abort(inflight, "deadline: the write did not end in time", ReadFailure.DEADLINE)
            await asyncio.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, POLL_MAX_S)
        if expectation.staged is not None:
            self._stage_done(slot, expectation, inflight, held)
        else:
            self._finish(slot, expectation, inflight, held)

    def _finish(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead | None, held: LiveHold,
                refusal: str = "") -> None:
        """Tell the decode rank, then count it as this hold's reader (its end goes on the bus)."""
        self._forget(slot, expectation)
        if expectation.timer is not None:
            expectation.timer.cancel()
        pusher = slot.pusher
        result: ReadResult | None = inflight.result if inflight is not None else None
        ok = result is not None and result.ok
        if ok:  # this side's check after the WRITE: were the source blocks still held when it ended?
            with slot.lock:
                now_held = slot.holds.lookup(expectation.transfer_id, time.monotonic())
            if now_held is None or now_held.capability != held.capability:
                ok = False
                inflight.result = dataclasses.replace(result, ok=False, error="the prefill hold ended while its "
                                                      "blocks were written: they may have been reused")
        if inflight is not None:
            self._count_copies(inflight)  # (before the notice: once the decode side completes, it is counted)
            pusher.send_notice(inflight, expectation.target_rank)
        else:
            self._tell(slot, expectation.connection, expectation.target_rank, expectation.transfer_id,
                       expectation.capability)
        metrics = self.daemon.metrics
        metrics.push_writes.labels("ok" if ok else "failed").inc()
        if ok:
            self.num_written += 1
            metrics.push_bytes.inc(expectation.num_bytes_written + result.num_bytes)
        expected = expected_readers(slot.cache, expectation.target_tp_size)
        notice = ReadNotice(expectation.transfer_id, expectation.target_engine_id, expectation.target_rank, expected, ok,
                            capability=held.capability)
        with slot.lock:
            try:
                outcome = slot.holds.record(notice, time.monotonic(), expected)
            except KvxferError:
                return
        if outcome.failed:
            self.daemon.publish(slot, HoldEnd(expectation.transfer_id, FAILED, (),
                                              f"push to {expectation.target_engine_id}/{expectation.target_rank} failed"
                                              f"{': ' + refusal if refusal else ''}"))
        if outcome.end is not None:
            self.daemon.publish(slot, outcome.end)

    def _count_copies(self, inflight: InFlightRead) -> None:
        copied = sum(rank.copied_here for rank in inflight.ranks.values())
        if copied:
            self.daemon.metrics.push_same_host_copies.inc(copied)

    def _refuse(self, slot: EngineSlot, connection: PushTarget | None, target_engine_id: str, target_rank: int,
                transfer_id: str, capability: bytes, why: str) -> None:
        """An expectation refused before anything was written: counted, logged, and told to its decode rank at
        once when it is connected (else that side fails it by its deadline)."""
        self.daemon.metrics.push_writes.labels("refused").inc()
        log.warning("a push expectation was refused", extra={
            "engine_id": slot.engine_id, "transfer_id": transfer_id, "reader": f"{target_engine_id}/{target_rank}",
            "error": why})
        if connection is not None:
            self._tell(slot, connection, target_rank, transfer_id, capability)

    def _tell(self, slot: EngineSlot, connection: PushTarget, target_rank: int, transfer_id: str,
              capability: bytes) -> None:
        """A failed writer's notice to a decode rank for an expectation nothing was written for (refused):
        its push fails now instead of at its deadline."""
        notice = ReadNotice(transfer_id, slot.engine_id, slot.cache.tp_rank,
                            connection.plans[target_rank].expected_writers, False, capability=capability)
        try:
            slot.pusher.notices.notify(connection.agent_names[target_rank], notice.encode())
        except KvxferError:
            return  # the decode side fails it by its deadline
        self.daemon.dataplane.notices_sent()

    @staticmethod
    def _forget(slot: EngineSlot, expectation: Expectation) -> None:
        waiting = slot.expectations.get(expectation.transfer_id, {})
        if waiting.get(expectation.key) is expectation:
            del waiting[expectation.key]
            if not waiting:
                del slot.expectations[expectation.transfer_id]
            counts = slot.num_expectations_by_owner
            counts[expectation.owner] -= 1
            if not counts[expectation.owner]:
                del counts[expectation.owner]

    async def engine_gone(self, slot: EngineSlot) -> None:
        """``slot``'s registration is closing: every decode rank whose push it has not begun writing (never
        held, or waiting for layers) is told now, instead of by the expectation's deadline; a write in flight
        is aborted and waited for (its drain: at most ``abort_drain_s`` or ``push_settle_s``), so its decode
        rank hears the WRITE is over instead of waiting its settle time. The notices are flushed (UCX sends them
        as its agent makes progress) before the agent goes with the registration."""
        told = 0
        for waiting in list(slot.expectations.values()):
            for expectation in list(waiting.values()):
                if not expectation.started or expectation.awaits_layers:
                    self._abandon(slot, expectation)
                    told += 1
        pusher = slot.pusher
        if pusher is None or not (told or slot.writing):
            return
        writing = dict(slot.writing)
        for inflight in writing:  # (each one's own task notices its end, and tells its decode rank)
            pusher.abort(inflight, "the prefill engine is deregistering")
        if writing:  # (no longer than a decode rank would wait for word of it: past that, word comes too late)
            await asyncio.wait(writing.values(), timeout=min(pusher.abort_drain_s, self.daemon.config.push_settle_s))
        until_s = time.perf_counter() + FLUSH_S
        while time.perf_counter() < until_s:
            with pusher.lock:
                try:
                    pusher.notices.poll_notifications()  # the engine is going: what arrives is of no use now
                except KvxferError:
                    return
            await asyncio.sleep(POLL_MAX_S)

    def _abandon(self, slot: EngineSlot, expectation: Expectation) -> None:
        """Forget an expectation nothing is being written for and tell its decode rank (a failed notice)."""
        self._forget(slot, expectation)
        if expectation.timer is not None:
            expectation.timer.cancel()
        self._tell(slot, expectation.connection, expectation.target_rank, expectation.transfer_id,
                   expectation.capability)

    def _expire(self, slot: EngineSlot, expectation: Expectation) -> None:
        """Its deadline passed before this engine held the transfer: forgotten, and the decode rank told (a failed
        notice: nothing was written, so its blocks need not wait for this writer)."""
        if not expectation.started:
            self._abandon(slot, expectation)
        elif expectation.awaits_layers:  # waiting for layers that never came
            held = self._same_hold(slot, expectation)
            if held is None:
                self._abandon(slot, expectation)
            else:
                self._finish(slot, expectation, None, held, "deadline: its last layers were never final")


def _names_memory(cache) -> bool:
    """Whether a target names the shared memory its regions lie in (only a proven same-host one keeps it)."""
    return any(region.share is not None for regions in cache.memory for region in regions)


def _agent_name(metadata: bytes) -> str:
    return agent_name_of(metadata, "target.agent_metadata")
