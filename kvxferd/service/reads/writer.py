"""Push, prefill side (issue #57): write a held transfer into the blocks decode ranks expect.

::

    Expect (peer port, authenticated)       the decode rank's engine info (checked as a handshake's), its
      checked, connected once per            block ids, the expectation's capability, a deadline
      (target engine, rank, agent)           kept until this engine holds the transfer (or the deadline)
    this engine's Hold of the transfer  ─┐
    an Expect for a transfer held already ┴─► plan (the decode rank's read plan, this rank's part) and post:
                                             the decode board checked, WRITE, checked again (xfer/pushes.py)
    the write ended                          the writer's notice to the decode rank (ok or failed); this
                                             engine's own hold counts that decode rank as read, so it ends
                                             CONSUMED (bus) once every decode rank it feeds was written

Nothing is written without this engine's live hold (its block ids) and the
decode rank's expectation on its board; the decode block ids come from the
decode daemon over the authenticated peer port, never from an engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxferd.errors import InvalidArgumentError, KvxferError, LayoutMismatchError, ResourceExhaustedError
from kvxferd.plan.capability import check_capability_bytes
from kvxferd.plan.engine import expected_readers
from kvxferd.plan.leases import FAILED, HoldEnd
from kvxferd.plan.notifications import ReadNotice
from kvxferd.plan.push import PushRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.wire.messages import check_id, check_seconds, ids_from_pb
from kvxferd.wire.peerinfo import decode_info
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import agent_name_of
from kvxferd.xfer.pushes import PushTarget
from kvxferd.xfer.records import InFlightRead, ReadResult

if TYPE_CHECKING:
    from kvxferd.service.reads.path import ReadPathParts

POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # a posted push is polled with growing sleeps


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

    async def expect(self, slot: EngineSlot, request: pb.ExpectRequest) -> None:
        """Keep (and, if the transfer is held already, start) one decode rank's expectation; typed errors
        for bad input, nothing kept."""
        daemon, config = self.daemon, self.daemon.config
        daemon.registry.check_accepting()
        if request.tp_rank != slot.cache.tp_rank:
            raise InvalidArgumentError("tp_rank", f"this daemon serves rank {slot.cache.tp_rank} of "
                                                  f"{slot.engine_id!r}, not {request.tp_rank}")
        transfer_id = check_id(request.transfer_id, "transfer_id")
        capability = check_capability_bytes(request.capability, "capability")
        deadline_s = check_seconds(request.deadline_s, "deadline_s", default_s=config.deadline_s,
                                   max_s=config.max_deadline_s)
        if request.num_tokens < 0:
            raise InvalidArgumentError("num_tokens", f"must not be negative, got {request.num_tokens}")
        pusher = slot.pusher
        if pusher is None:
            raise LayoutMismatchError("push", f"engine {slot.engine_id!r} does not push from this daemon (its reads "
                                              "run in a worker)")
        if sum(len(e) for e in slot.expectations.values()) >= config.max_holds_per_engine:
            raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} keeps "
                                                                 f"{config.max_holds_per_engine} expectations already")
        try:
            info = decode_info(request.target, slot.cache)
        except KvxferError as err:
            raise type(err)(f"target.{err.field}", err.message) from None
        target = info.cache
        block_ids = ids_from_pb(request.target_block_ids)
        if len(block_ids) != len(target.groups):
            raise InvalidArgumentError("target_block_ids", f"{len(block_ids)} groups given, the target has "
                                                           f"{len(target.groups)}")
        connection = await self._connection(slot, info)
        if connection is None:
            raise InvalidArgumentError("tp_rank", f"rank {slot.cache.tp_rank} holds nothing rank {target.tp_rank} "
                                                  f"of {target.engine_id!r} needs")
        expectation = Expectation(transfer_id, target.engine_id, target.tp_rank, target.tp_size, block_ids,
                                  request.num_tokens or None, capability, time.perf_counter() + deadline_s, connection)
        waiting = slot.expectations.setdefault(transfer_id, {})
        earlier = waiting.get(expectation.key)
        if earlier is not None and earlier.started:
            raise InvalidArgumentError("transfer_id", f"rank {target.tp_rank} of {target.engine_id!r} was written "
                                                      f"for {transfer_id!r} already")
        if earlier is not None and earlier.timer is not None:
            earlier.timer.cancel()
        waiting[expectation.key] = expectation
        expectation.timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, slot, expectation)
        self.on_hold(slot, transfer_id)

    async def _connection(self, slot: EngineSlot, info) -> PushTarget | None:
        """The push connection to the target rank, made once per target agent (again when it restarted)."""
        pusher, target = slot.pusher, info.cache
        current = pusher.targets.get((target.engine_id, target.tp_rank))
        if current is not None and current.agent_names.get(target.tp_rank) == _agent_name(info.agent_metadata):
            return current
        return await asyncio.wrap_future(self.daemon.dataplane.call(
            lambda: pusher.connect(target, info.agent_metadata, info.board)))

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
            planned = pusher.plan(expectation.connection, expectation.target_rank, push)
        except KvxferError as err:  # ids that do not pair: the decode rank is told, nothing written
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
