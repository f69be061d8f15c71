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
from kvxferd.plan.leases import FAILED, HoldEnd
from kvxferd.plan.notifications import ReadNotice
from kvxferd.plan.push import PushRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.wire.messages import check_id
from kvxferd.wire.peerinfo import decode_info
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import agent_name_of
from kvxferd.xfer.pushes import PushTarget
from kvxferd.xfer.records import InFlightRead, ReadResult

if TYPE_CHECKING:
    from kvxferd.service.reads.path import ReadPathParts

log = logging.getLogger("kvxferd.push")

POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # a posted push is polled with growing sleeps
WARM_UP_S = 5.0  # a new connection's first READ may take this long (then the first push pays the rest)


@dataclass(eq=False)
class Expectation:
    """What one decode rank expects of this prefill rank for one transfer."""

    transfer_id: str
    target_engine_id: str
    target_rank: int
    target_tp_size: int
    target_block_ids: tuple
    num_tokens: int | None
    capability: bytes
    deadline_s: float  # perf_counter: no write is posted after it
    connection: PushTarget
    started: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return self.target_engine_id, self.target_rank


class WritePath:
    """The expectations of this daemon's engine ranks, written once their engine holds the transfer."""

    def __init__(self, daemon: "ReadPathParts") -> None:
        self.daemon = daemon
        self.num_written = 0  # pushes whose write ended ok
        self._connecting: dict[tuple, asyncio.Task] = {}  # (id(slot), target engine, rank) -> its connection

    def connect_target(self, slot: EngineSlot, reader_target: pb.EngineInfoReply) -> None:
        """An introduced reader's rank as a push target (its handshake, ``EngineInfoRequest.reader_target``):
        connected in the background (UCX's set-up of a new connection takes up to a second; the reader's
        handshake does not wait for it), not on its first push. A target that cannot be connected is
        logged; its pushes fail."""
        if slot.pusher is None or not self.daemon.config.push_targets:
            return  # (push_targets off: this daemon loads no reader's agent)
        try:
            info = decode_info(reader_target, slot.cache)
        except KvxferError as err:
            log.warning("a reader's push target was refused: its pushes will fail", extra={
                "engine_id": slot.engine_id, "error": str(err)})
            return
        key = (id(slot), info.cache.engine_id, info.cache.tp_rank)
        self._connecting[key] = self.daemon.spawn(self._connect(slot, info, key))

    async def _connect(self, slot: EngineSlot, info, key) -> None:
        try:
            await self._connection(slot, info)
        except KvxferError as err:
            log.warning("a reader's push target was not connected: its pushes will fail", extra={
                "engine_id": slot.engine_id, "error": str(err)})
        finally:
            if self._connecting.get(key) is asyncio.current_task():
                del self._connecting[key]

    def expect_records(self, records: list[tuple[EngineSlot, ExpectRecord]]) -> None:
        """A data-plane round's expectations, each from the agent introduced for its decode rank (event loop);
        one whose target is still being connected is taken once it is."""
        for slot, record in records:
            if slot.closing:
                continue
            connecting = self._connecting.get((id(slot), record.reader_engine_id, record.reader_rank))
            if connecting is not None:
                connecting.add_done_callback(lambda _, slot=slot, record=record: self.expect_records([(slot, record)]))
                continue
            try:
                self._expect(slot, record)
            except KvxferError as err:  # refused: nothing kept; the decode side fails it by its deadline
                self.daemon.metrics.push_writes.labels("refused").inc()
                log.warning("a push expectation was refused", extra={
                    "engine_id": slot.engine_id, "transfer_id": record.transfer_id,
                    "reader": f"{record.reader_engine_id}/{record.reader_rank}", "error": str(err)})

    def _expect(self, slot: EngineSlot, record: ExpectRecord) -> None:
        """Keep (and, if the transfer is held already, start) one decode rank's expectation."""
        config = self.daemon.config
        check_id(record.transfer_id, "expectation.transfer_id")
        deadline_s = min(record.deadline_s, config.max_deadline_s)
        pusher = slot.pusher
        connection = None if pusher is None else pusher.targets.get((record.reader_engine_id, record.reader_rank))
        if connection is None:
            raise NotFoundError("expectation", f"rank {record.reader_rank} of {record.reader_engine_id!r} is not "
                                               "connected as a push target (no handshake named it, or this rank "
                                               "holds nothing it needs)")
        plan = connection.plans[record.reader_rank]
        if len(record.block_ids) != len(plan.target.groups):
            raise InvalidArgumentError("expectation.block_ids", f"{len(record.block_ids)} groups, the target has "
                                                                f"{len(plan.target.groups)}")
        if sum(len(e) for e in slot.expectations.values()) >= config.max_holds_per_engine:
            raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} keeps "
                                                                 f"{config.max_holds_per_engine} expectations already")
        expectation = Expectation(record.transfer_id, record.reader_engine_id, record.reader_rank,
                                  plan.target.tp_size, record.block_ids, record.num_tokens, record.capability,
                                  time.perf_counter() + deadline_s, connection)
        waiting = slot.expectations.setdefault(record.transfer_id, {})
        earlier = waiting.get(expectation.key)
        if earlier is not None:  # one expectation per transfer and decode rank: a second is not taken
            raise InvalidArgumentError("expectation.transfer_id", f"rank {record.reader_rank} of "
                                                                  f"{record.reader_engine_id!r} expects "
                                                                  f"{record.transfer_id!r} already")
        waiting[expectation.key] = expectation
        expectation.timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, slot, expectation)
        self.on_hold(slot, record.transfer_id)

    async def _connection(self, slot: EngineSlot, info) -> PushTarget | None:
        """The push connection to the target rank, made once per target agent (again when it restarted)."""
        pusher, target = slot.pusher, info.cache
        current = pusher.targets.get((target.engine_id, target.tp_rank))
        if current is not None and current.agent_names.get(target.tp_rank) == _agent_name(info.agent_metadata):
            return current
        connection = await asyncio.wrap_future(self.daemon.dataplane.call(
            lambda: pusher.connect(target, info.agent_metadata, info.board)))
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
        if held is None:
            return  # not held yet: the engine's Hold starts them
        for expectation in list(waiting.values()):
            if not expectation.started:
                self._start(slot, expectation, held)

    def _start(self, slot: EngineSlot, expectation: Expectation, held: tuple[tuple, bytes]) -> None:
        expectation.started = True
        if expectation.timer is not None:
            expectation.timer.cancel()
        pusher = slot.pusher
        block_ids, _ = held
        push = PushRequest(expectation.transfer_id, expectation.target_block_ids, block_ids, expectation.capability,
                           expectation.num_tokens)
        try:
            if pusher.targets.get(expectation.key) is not expectation.connection:
                raise NotFoundError("expectation", "the connection to the target rank was replaced (it restarted): "
                                                   "its new agent expects anew")
            planned = pusher.plan(expectation.connection, expectation.target_rank, push)
        except KvxferError as err:  # ids that do not pair, a replaced target: the decode rank is told, nothing written
            self._finish(slot, expectation, None, held, f"push refused: {err}")
            return
        inflight = pusher.post(expectation.connection, planned)
        if pusher.poll(inflight) is not None:
            self._finish(slot, expectation, inflight, held)
        else:
            self.daemon.spawn(self._wait(slot, expectation, inflight, held))

    async def _wait(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead, held) -> None:
        pusher, sleep_s = slot.pusher, POLL_MIN_S
        while pusher.poll(inflight) is None:
            if time.perf_counter() >= expectation.deadline_s and inflight.drain is None:
                pusher.abort(inflight, "deadline: the write did not end in time", ReadFailure.DEADLINE)
            await asyncio.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, POLL_MAX_S)
        self._finish(slot, expectation, inflight, held)

    def _finish(self, slot: EngineSlot, expectation: Expectation, inflight: InFlightRead | None, held,
                refusal: str = "") -> None:
        """Tell the decode rank, then count it as this hold's reader (its end goes on the bus)."""
        waiting = slot.expectations.get(expectation.transfer_id, {})
        if waiting.get(expectation.key) is expectation:
            del waiting[expectation.key]
            if not waiting:
                del slot.expectations[expectation.transfer_id]
        pusher = slot.pusher
        result: ReadResult | None = inflight.result if inflight is not None else None
        ok = result is not None and result.ok
        if ok:  # this side's check after the WRITE: were the source blocks still held when it ended?
            with slot.lock:
                now_held = slot.holds.lookup(expectation.transfer_id, time.monotonic())
            if now_held is None or now_held[1] != held[1]:
                ok = False
                inflight.result = dataclasses.replace(result, ok=False, error="the prefill hold ended while its "
                                                      "blocks were written: they may have been reused")
        if inflight is not None:
            pusher.send_notice(inflight, expectation.target_rank)
        else:
            notice = ReadNotice(expectation.transfer_id, slot.engine_id, slot.cache.tp_rank,
                                expectation.connection.plans[expectation.target_rank].expected_writers, False,
                                capability=expectation.capability)
            try:
                pusher.notices.notify(expectation.connection.agent_names[expectation.target_rank], notice.encode())
            except KvxferError:
                pass
        metrics = self.daemon.metrics
        metrics.push_writes.labels("ok" if ok else "failed").inc()
        if ok:
            self.num_written += 1
            metrics.push_bytes.inc(result.num_bytes)
        _, capability = held
        expected = expected_readers(slot.cache, expectation.target_tp_size)
        notice = ReadNotice(expectation.transfer_id, expectation.target_engine_id, expectation.target_rank, expected, ok,
                            capability=capability)
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

    def _expire(self, slot: EngineSlot, expectation: Expectation) -> None:
        """Its deadline passed before this engine held the transfer: forgotten (the decode side fails it)."""
        waiting = slot.expectations.get(expectation.transfer_id, {})
        if waiting.get(expectation.key) is expectation and not expectation.started:
            del waiting[expectation.key]
            if not waiting:
                del slot.expectations[expectation.transfer_id]


def _agent_name(metadata: bytes) -> str:
    return agent_name_of(metadata, "target.agent_metadata")
