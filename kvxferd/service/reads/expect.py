"""Push, decode side (issue #57): the engine's blocks expected, written by the prefill ranks, completed as a read.

::

    ReadSpec with push (a Reads batch)            checks as a read's; the link to the prefill engine ready
      expectation = a hold of the decode blocks   on this rank's own hold table and board: its capability
        under the transfer id                     seals the transfer id and exactly these block ids
      writers introduced                          every prefill rank of the read plan's notify set, by the
                                                  agent its handshake named (EngineInfo.writer_agent_name)
      an expectation -> each of those ranks       a NIXL notification from this rank's notice agent (the one
                                                  its handshake introduced): block ids, capability, deadline
                                                  (the handshake gave them this rank's engine info to WRITE)
    the hold ends (data-plane thread, bus path)
      CONSUMED, no writer failed  ─► completion ok
      CONSUMED with failed writers            ─► completion failed, every block invalid (each writer's
                                                  notice came after its WRITE was over)
      EXPIRED (deadline), released            ─► completion failed, every block invalid, once every writer
                                                  that had not reported did (its notice comes after its
                                                  WRITE drained; a writer that never held says so at its
                                                  deadline), at most push_settle_s later: a WRITE that
                                                  passed its board check just before the end may still land

The writers check this rank's board before and after they WRITE (the tag of
the expectation), so nothing is written into an expectation that ended, and
a notice counts only with its capability, from the agent introduced for
that writer. A push's completion reports no byte count (the writers count
their bytes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvxferd.errors import (InvalidArgumentError, KvxferError, LayoutMismatchError, NotFoundError,
                            ResourceExhaustedError, UnavailableError)
from kvxferd.plan.capability import check_push_key
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.expectrecord import ExpectRecord
from kvxferd.plan.leases import CONSUMED, FAILED, HoldEnd
from kvxferd.plan.push import expected_writers
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.read import Read, ReadState
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.wire.messages import check_id, check_seconds, unpack_ids
from kvxferd.wire.tracecontext import check_traceparent
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.holder import Reader
from kvxferd.xfer.records import ReadResult

if TYPE_CHECKING:
    from kvxferd.service.base.config import DaemonConfig
    from kvxferd.service.base.spans import DaemonSpans
    from kvxferd.service.dataplane.thread import DataPlane
    from kvxferd.service.engines.registry import Registry


class ExpectParts(Protocol):
    """What the decode side of a push uses of the daemon (the read path's parts are these and more)."""

    config: DaemonConfig
    spans: DaemonSpans
    registry: Registry
    dataplane: DataPlane

    def wake_maintenance(self) -> None:
        """Something to expire appeared: back to the short maintenance tick now."""

WRITER_IDENTITY = "push"  # the readers table's identity of introduced writers (this daemon introduced them)


class ExpectPath:
    """Expectations of the engine ranks registered here, and their completions."""

    def __init__(self, daemon: ExpectParts, done: Callable[[list[Read]], None]) -> None:
        """``done``: the read path's books of ended reads (completions, metrics)."""
        self.daemon, self._done = daemon, done

    def submit(self, slot: EngineSlot, spec: pb.ReadSpec, received_s: float) -> None:
        """Expect a push (a ReadSpec with ``push``); raises a typed error when refused, nothing held."""
        daemon, config = self.daemon, self.daemon.config
        daemon.registry.check_accepting()
        check_id(spec.request_id, "request_id")
        transfer_id = check_id(spec.remote_request_id, "remote_request_id")
        if spec.remote_block_ids or any(spec.remote_group_sizes) or spec.remote_capabilities:
            raise InvalidArgumentError("remote_block_ids", "a push names no prefill blocks or capabilities: the "
                                                           "prefill engine's hold of the transfer does")
        push_key = check_push_key(spec.push_key, "push_key")
        if spec.num_tokens < 0:
            raise InvalidArgumentError("num_tokens", f"must not be negative, got {spec.num_tokens}")
        earlier = slot.reads.get(spec.request_id)
        if earlier is not None and earlier.state is not ReadState.DELIVERED:
            raise InvalidArgumentError("request_id", f"request {spec.request_id!r} is already in flight")
        if len(slot.reads) + len(slot.completions) >= config.max_reads_per_engine:
            raise ResourceExhaustedError("max_reads_per_engine", f"{config.max_reads_per_engine} reads are in "
                                                                 "flight or not acked yet")
        if config.require_digests:
            raise UnavailableError("push", "this daemon checks every read against its holds' digests "
                                   "(require_digests), and a push's writes are not checked yet: read instead")
        link = slot.links.get(spec.remote_engine_id)
        if link is None or link.remote is None:
            raise NotFoundError("remote_engine_id", f"no handshake with {spec.remote_engine_id!r} yet")
        if not link.ready:
            raise UnavailableError("remote_engine_id", f"the link to {spec.remote_engine_id!r} is being "
                                                       "handshaken again: send the push again")
        if slot.served is not None:
            raise LayoutMismatchError("push", "push into a rank served by a data-plane worker is not built yet")
        if not config.push_targets:
            raise LayoutMismatchError("push", "push_targets is off on this daemon: its ranks are no write targets")
        writers = link.remote.plan.notify_ranks
        if not all(q < len(link.writer_agents) and link.writer_agents[q] for q in writers):
            raise LayoutMismatchError("push", f"a prefill daemon of {spec.remote_engine_id!r} does not push "
                                              "(push_targets is off there, its reads run in a worker, or it is older)")
        block_ids = self._block_ids(slot, spec)
        deadline_s = check_seconds(spec.deadline_s, "deadline_s", default_s=config.deadline_s,
                                   max_s=config.max_deadline_s)
        if len(slot.holds) >= config.max_holds_per_engine:
            raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} holds "
                                                                 f"{config.max_holds_per_engine} requests already")
        prefill_tp = len(link.remote.agent_names)
        expected = expected_writers(slot.cache, prefill_tp)
        for q in writers:  # idempotent: the same agent again changes nothing
            slot.holder.introduce((spec.remote_engine_id, q), Reader(link.writer_agents[q], prefill_tp, expected,
                                                                     WRITER_IDENTITY))
        if transfer_id in slot.expected or transfer_id in slot.settling:
            raise InvalidArgumentError("remote_request_id", f"transfer {transfer_id!r} is already held: a push of it "
                                                            "is still running (or its writers are settling)")
        _claim_blocks(slot, block_ids)  # another live expectation's blocks: refused, nothing held
        try:
            with slot.lock:  # the tag goes on the board before any writer can look for it
                capability = slot.holds.hold(transfer_id, block_ids, deadline_s, time.monotonic())
        except BaseException:
            _free_blocks(slot, block_ids)
            raise
        request = ReadRequest(spec.request_id, transfer_id, block_ids, tuple(() for _ in block_ids),
                              spec.num_tokens or None)
        read = Read(slot, spec.remote_engine_id, request, link.remote, received_s, received_s + deadline_s, push=True,
                    traceparent=check_traceparent(spec.traceparent) if self.daemon.spans.on else "")
        slot.reads[spec.request_id] = slot.expected[transfer_id] = read
        daemon.dataplane.wake()  # fast polls: the writers' WRITEs over TCP need this side's progress
        daemon.wake_maintenance()  # the expectation's deadline is its lease
        self._send(slot, link, read, capability, push_key, deadline_s)

    @staticmethod
    def _block_ids(slot: EngineSlot, spec: pb.ReadSpec) -> tuple[np.ndarray, ...]:
        block_ids = unpack_ids(spec.local_block_ids, spec.local_group_sizes, "local_block_ids")
        groups = slot.cache.groups
        if len(block_ids) != len(groups):
            raise InvalidArgumentError("local_block_ids", f"{len(block_ids)} groups given, engine has {len(groups)}")
        for g, (ids, group) in enumerate(zip(block_ids, groups)):
            if len(ids) and (ids.min() < 0 or ids.max() >= group.spec.num_blocks):
                raise InvalidArgumentError(f"local_block_ids[{g}]", f"block ids must lie in [0, {group.spec.num_blocks})")
            if len(np.unique(ids)) != len(ids):
                raise InvalidArgumentError(f"local_block_ids[{g}]", "a block is named twice")
        return block_ids

    def _send(self, slot: EngineSlot, link, read: Read, capability: bytes, push_key: bytes, deadline_s: float) -> None:
        """Tell every writer what to write: one NIXL notification from this rank's notice agent (introduced to
        each prefill rank at the handshake) per writer. A writer that cannot be told fails the push."""
        record = ExpectRecord(read.request.remote_request_id, slot.engine_id, slot.cache.tp_rank,
                              read.request.local_block_ids, capability, deadline_s, push_key,
                              read.request.num_tokens).encode()
        errors = []
        for q in link.remote.plan.notify_ranks:
            try:
                slot.executor.notify_holder(link.remote.agent_names[q], record)
            except KvxferError as err:
                errors.append(f"prefill rank {q}: {err}")
        self.daemon.dataplane.notices_sent()  # the data-plane thread makes progress for the notice agent
        if errors:
            link.stale = True  # the next read or push re-handshakes (a restarted prefill daemon is picked up)
            self.abandon(slot, read.request.remote_request_id, "push: " + "; ".join(errors), ReadFailure.HANDSHAKE,
                         settle=len(errors) < len(link.remote.plan.notify_ranks))

    def abandon(self, slot: EngineSlot, transfer_id: str, error: str, failure: ReadFailure, *, settle: bool) -> None:
        """End an expectation before its writers did: its tag off the board first (no writer checks it in
        any more), then the engine's failed completion (after push_settle_s when a writer may be writing)."""
        read = slot.expected.pop(transfer_id, None)
        slot.heard_late.pop(transfer_id, None)
        if read is None:
            return
        _free_blocks(slot, read.request.local_block_ids)
        with slot.lock:
            try:
                slot.holds.release(transfer_id)
            except KvxferError:
                pass  # ended meanwhile
        self._complete(read, False, error, failure, settle)

    def ended(self, slot: EngineSlot, end: HoldEnd) -> bool:
        """A hold of ``slot`` ended (event-loop thread): True when it was an expectation, whose read is
        completed here instead of the end being published on the bus."""
        read = slot.expected.get(end.request_id)
        if read is None:
            return False
        if end.kind is FAILED:  # a writer failed: the end follows once every writer reported
            return True
        del slot.expected[end.request_id]
        if end.kind is CONSUMED:
            slot.heard_late.pop(end.request_id, None)
        if end.kind is CONSUMED and not end.failed_readers:
            _free_blocks(slot, read.request.local_block_ids)
            self._complete(read, True, "", ReadFailure.NONE, settle=False)
        elif end.kind is CONSUMED:  # every writer reported, each after its WRITE was over: nothing lands later
            _free_blocks(slot, read.request.local_block_ids)
            failed = ", ".join(f"rank {rank}" for _, rank in end.failed_readers)
            self._complete(read, False, f"push: the write of prefill {failed} failed", ReadFailure.TRANSFER, False)
        else:
            reason = "deadline: not every prefill rank wrote in time" if end.reason == "lease" else end.reason
            failure = ReadFailure.DEADLINE if end.reason == "lease" else ReadFailure.ABORTED
            writers = set() if read.remote is None else {(read.remote_engine_id, q)
                                                         for q in read.remote.plan.notify_ranks}
            heard = slot.heard_late.pop(end.request_id, set())  # late notices handed over before this end
            self._settle(slot, end.request_id, read, f"push: {reason}", failure,
                         writers - set(end.reported) - heard)
        return True

    def _settle(self, slot: EngineSlot, transfer_id: str, read: Read, error: str, failure: ReadFailure,
                waiting: set) -> None:
        """Fail an expectation that ended before every writer reported, once the rest did (their notices come
        after their WRITEs drained) or push_settle_s passed; its blocks stay claimed meanwhile."""
        def done() -> None:
            if slot.settling.get(transfer_id) is settling:
                del slot.settling[transfer_id]
                _free_blocks(slot, read.request.local_block_ids)
                self._complete(read, False, error, failure, settle=False)

        settling = Settling(waiting, done)
        if not waiting:
            slot.settling[transfer_id] = settling
            done()
            return
        settling.timer = asyncio.get_running_loop().call_later(self.daemon.config.push_settle_s, done)
        slot.settling[transfer_id] = settling

    def late(self, slot: EngineSlot, end: HoldEnd) -> None:
        """A writer's notice after its expectation ended (event-loop thread): its WRITE is over; the push fails
        now when it was the last one its expectation waited for."""
        settling = slot.settling.get(end.request_id)
        if settling is None:
            # Its hold ended on the data-plane thread, and this notice was handed over before that end: kept
            # for the end (only for a push this rank still expects, so bounded by its expectations).
            if end.request_id in slot.expected:
                slot.heard_late.setdefault(end.request_id, set()).update(end.failed_readers)
            return
        settling.waiting.difference_update(end.failed_readers)
        if not settling.waiting:
            settling.timer.cancel()
            settling.done()

    def _complete(self, read: Read, ok: bool, error: str, failure: ReadFailure, settle: bool) -> None:
        invalid = () if ok else tuple(np.unique(np.asarray(ids, dtype=np.int64)) for ids in read.request.local_block_ids)
        result = ReadResult(read.request_id, read.remote_engine_id, ok, 0, 0, 0.0,
                            invalid or tuple(np.zeros(0, np.int64) for _ in read.request.local_block_ids),
                            (), error or None, failure)

        def complete() -> None:
            read.end(result, failure)
            self._done([read])

        settle_s = self.daemon.config.push_settle_s if settle and not ok else 0.0
        if settle_s:
            asyncio.get_running_loop().call_later(settle_s, complete)
        else:
            complete()


@dataclass(eq=False)
class Settling:
    """A failed push waiting for its remaining writers: (prefill engine id, rank) pairs not heard from yet."""

    waiting: set
    done: Callable[[], None]
    timer: asyncio.TimerHandle | None = None


def _claim_blocks(slot: EngineSlot, block_ids: tuple[np.ndarray, ...]) -> None:
    """Mark blocks as expected; refuse (typed error, nothing marked) blocks another live expectation of this
    engine rank names: two pushes writing one block would corrupt one of them."""
    claimed = slot.expected_blocks or [set() for _ in block_ids]
    for g, ids in enumerate(block_ids):
        taken = claimed[g].intersection(ids.tolist())
        if taken:
            raise InvalidArgumentError(f"local_block_ids[{g}]", f"blocks {sorted(taken)[:8]} are expected by another "
                                                                "push of this engine still running")
    for g, ids in enumerate(block_ids):
        claimed[g].update(ids.tolist())
    slot.expected_blocks = claimed


def _free_blocks(slot: EngineSlot, block_ids) -> None:
    for g, ids in enumerate(block_ids):
        if g < len(slot.expected_blocks):
            slot.expected_blocks[g].difference_update(np.asarray(ids).tolist())
