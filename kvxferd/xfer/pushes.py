"""Push (issue #57): one prefill rank WRITEs its hold's blocks into the blocks a decode rank expects.

::

    connect(target ranks' caches + agent metadata + boards)   once per target (decode) engine
      PushPlan per target rank this rank notifies             pure, validated (plan/push.py)
      add_remote x T (data and notice agent); prep_xfer_dlist x 3 per written rank
    post(target, rank d, PushRequest)                         runs on the reads' rank machine:
      check d's board for the expectation's tag  ─ none ─►    stale, nothing written
      WRITE (this cache's spans -> d's spans)
      check d's board again                      ─ none ─►    stale: the expectation ended meanwhile
    send_notice                                               once, after the result: the writer's
                                                              notice to d (ok or failed), sealed by the
                                                              expectation's capability; d counts writers

The expectation on the decode side is a hold of the decode blocks
(:class:`kvxferd.xfer.holder.Holder`): its capability seals the transfer id
and the decode block ids, its tag sits on the decode rank's board while the
blocks may be written, and the decode rank ends it ``CONSUMED`` once every
writer it expects (:func:`kvxferd.plan.push.expected_writers`) notified ok.
A writer that only replicates data another rank writes sends its notice
with nothing written.

Shares the read executor's agent (the cache is registered there), check
area, notice agent and lock; writes move over NIXL only (no same-host copy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError
from kvxferd.plan.board import BoardInfo, hold_tag
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import ReadNotice
from kvxferd.plan.push import PlannedPush, PushPlan, PushRequest
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.movers import WriteMover
from kvxferd.xfer.nixl.agent import NixlError
from kvxferd.xfer.nixl.checks import board_rows
from kvxferd.xfer.rankmachine import RankMachine
from kvxferd.xfer.rankstate import RankTransfer
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import AdmittedRead, InFlightRead, ReadResult, ReadTimes


@dataclass(eq=False)
class PushTarget:
    """A connected target engine, seen from one writer rank. Per target rank: its plan and agent; per
    rank written: the prepared lists (this cache's spans, the target's, the target's board). Shaped as
    the rank machine's connection (``local_lists`` ... ``host_ranks``)."""

    engine_id: str
    plans: dict[int, PushPlan]  # target rank -> plan, for every target rank this writer notifies
    agent_names: dict[int, str]
    local_lists: dict[int, object] = field(default_factory=dict)
    remote_lists: dict[int, object] = field(default_factory=dict)
    board_lists: dict[int, object] = field(default_factory=dict)
    board_buckets: dict[int, int] = field(default_factory=dict)
    host_ranks: dict = field(default_factory=dict)  # no same-host writes: always empty
    loaded: list = field(default_factory=list)  # (agent, remote name): one reference each, as connect took it


class PushExecutor:
    """Writes one local engine rank's blocks into target engines; built on that rank's read executor."""

    def __init__(self, reads: ReadExecutor) -> None:
        self.reads = reads
        self.agent, self.cache, self.notices, self.lock = reads.agent, reads.cache, reads.notices, reads.lock
        self.machine = RankMachine(reads.checks, WriteMover(reads.agent))
        self.targets: dict[str, PushTarget] = {}
        self.abort_drain_s = reads.abort_drain_s
        self.num_notices_sent = 0

    # ---- connections -------------------------------------------------------
    def connect(self, targets: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo]) -> PushTarget:
        """Plan and prepare writes into a target engine (one cache, agent metadata and board per rank). A bad
        target leaves nothing behind; connecting again replaces the earlier connection."""
        if not targets:
            raise InvalidArgumentError("targets", "need the cache of every target rank")
        if not len(targets) == len(metadata) == len(boards):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata and {len(boards)} boards for "
                                                   f"{len(targets)} target ranks")
        with self.lock:
            plans = {d: plan for d, plan in ((d, PushPlan(self.cache, t)) for d, t in enumerate(targets)) if plan.notifies}
            engine_id = targets[0].engine_id
            if engine_id in self.targets:
                self.disconnect(engine_id)
            target = PushTarget(engine_id, plans, {})
            try:
                for d, plan in plans.items():
                    name = self.agent.add_remote(metadata[d], f"metadata[{d}]")
                    target.agent_names[d] = name
                    target.loaded.append((self.agent, name))
                    self.notices.add_remote(metadata[d], f"metadata[{d}]")
                    target.loaded.append((self.notices, name))
                    self.notices.connect_to(name)
                    if plan.writes:
                        target.local_lists[d] = self.agent.prep_local(plan.writer_rows, self.cache.mem_type)
                        target.remote_lists[d] = self.agent.prep_remote(name, plan.target_rows, targets[d].mem_type)
                        target.board_lists[d] = self.agent.prep_remote(
                            name, board_rows(boards[d].address, boards[d].num_buckets), "DRAM")
                        target.board_buckets[d] = boards[d].num_buckets
            except BaseException:
                self._release(target)
                raise
            self.targets[engine_id] = target
            return target

    def target(self, engine_id: str) -> PushTarget:
        """The current connection to a target engine; :class:`NotFoundError` when there is none."""
        try:
            return self.targets[engine_id]
        except KeyError:
            raise NotFoundError("engine_id", f"no connection to target engine {engine_id!r}") from None

    def disconnect(self, engine_id: str) -> None:
        """Forget a target engine (its lists and agents)."""
        with self.lock:
            target = self.targets.pop(engine_id, None)
            if target is not None:
                self._release(target)

    def close(self) -> None:
        with self.lock:
            for engine_id in list(self.targets):
                self.disconnect(engine_id)

    def _release(self, target: PushTarget) -> None:
        for lists in (target.local_lists, target.remote_lists, target.board_lists):
            for handle in lists.values():
                handle.release()
            lists.clear()
        while target.loaded:
            agent, name = target.loaded.pop()
            try:
                agent.remove_remote(name)
            except (NixlError, KvxferError):
                pass  # gone already (the peer went away)

    # ---- pushes --------------------------------------------------------------
    def plan(self, target: PushTarget, target_rank: int, request: PushRequest) -> PlannedPush:
        """``request`` planned for one target rank (typed errors naming the bad ids, nothing posted)."""
        plan = target.plans.get(target_rank)
        if plan is None:
            raise InvalidArgumentError("target_rank", f"rank {self.cache.tp_rank} holds nothing target rank "
                                                      f"{target_rank} of {target.engine_id!r} needs")
        return plan.plan_request(request)

    def post(self, target: PushTarget, planned: PlannedPush, start_s: float | None = None) -> InFlightRead:
        """Post a planned push (its board check first). A push that writes nothing (this rank only
        notifies) ends at once, ok."""
        with self.lock:
            ranks = {} if planned.write is None else {
                planned.write.remote_rank: RankTransfer(planned.write, hold_tag(planned.request.capability))}
            admitted = AdmittedRead(target, planned.request, planned)
            inflight = InFlightRead(admitted, ranks, ReadTimes(time.perf_counter() if start_s is None else start_s))
            self.machine.start(inflight)
            self._poll(inflight)
            return inflight

    def poll(self, inflight: InFlightRead) -> ReadResult | None:
        """Advance a posted push; its result once its write and both checks ended."""
        with self.lock:
            return self._poll(inflight)

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure = ReadFailure.ABORTED) -> ReadResult | None:
        """Fail the push; a WRITE in flight drains first (None until then: :meth:`poll`)."""
        with self.lock:
            if inflight.result is None:
                self.machine.abort(inflight, reason, failure, self.abort_drain_s)
            return self._poll(inflight)

    def _poll(self, inflight: InFlightRead) -> ReadResult | None:
        if inflight.result is None:
            if inflight.drain is not None:
                if not self.machine.settle(inflight):
                    return None
            elif not self.machine.advance(inflight):
                return None
            inflight.result = self._finish(inflight)
        return inflight.result

    def _finish(self, inflight: InFlightRead) -> ReadResult:
        planned: PlannedPush = inflight.planned
        errors = inflight.errors
        if not inflight.times.transferred_s:
            inflight.times.transferred_s = time.perf_counter()
        unsettled = inflight.drain is not None and inflight.drain.unsettled
        invalid = planned.invalid_block_ids() if errors else tuple(np.zeros(0, np.int64) for _ in planned.target_units)
        error = "; ".join(f"target rank {d}: {e}" for d, e in sorted(errors.items()))
        num_descriptors = 0 if planned.write is None else planned.write.num_descriptors
        return ReadResult(planned.request.transfer_id, inflight.remote.engine_id, not errors,
                          0 if errors else planned.num_bytes, num_descriptors,
                          time.perf_counter() - inflight.times.start_s, invalid, tuple(sorted(errors)),
                          error or None, inflight.failure, unsettled)

    # ---- notices -------------------------------------------------------------
    def send_notice(self, inflight: InFlightRead, target_rank: int) -> None:
        """Tell the target rank how this writer's part went, once (nothing before the result, nothing when
        the expectation had ended: that notice could only count for a later one)."""
        with self.lock:
            result = inflight.result
            if result is None or inflight.notified:
                return
            inflight.notified = True
            rank = inflight.ranks.get(target_rank)
            if rank is not None and rank.failure is ReadFailure.STALE:
                return
            planned: PlannedPush = inflight.planned
            target = inflight.remote
            notice = ReadNotice(planned.request.transfer_id, self.cache.engine_id, self.cache.tp_rank,
                                planned.plan.expected_writers, result.ok, alone=rank is None or not rank.waited,
                                capability=planned.request.capability)
            try:
                self.notices.notify(target.agent_names[target_rank], notice.encode())
                self.notices.poll_notifications()
            except KvxferError:  # the target went away: its expectation ends by its deadline
                pass
            self.num_notices_sent += 1
