"""Push (issue #57): one prefill rank WRITEs its hold's blocks into the blocks a decode rank expects.

::

    connect(target rank's cache + agent metadata + board)     once per target (decode) rank
      PushPlan, if this rank notifies that target rank         pure, validated (plan/push.py)
      add_remote (data and notice agent); prep_xfer_dlist x 3 when it writes
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
area, notice agent and lock. A target whose daemon proved it shares this
host (the handshake's same-host token) and named its engine's shared memory
is mapped read-write at connect and written by a copy in the kernel, as a
same-host read copies (:func:`kvxferd.xfer.samehost.ranks.open_push_target`);
board checks, notices and deadlines stay the same. Else, and for GPU memory,
a NIXL WRITE.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError, TransferError
from kvxferd.plan.board import BoardInfo, hold_tag
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import ReadNotice
from kvxferd.plan.engine import RankRead
from kvxferd.plan.push import PlannedPush, PushPlan, PushRequest
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.movers import WriteMover
from kvxferd.xfer.nixl.agent import NixlError, TransferState
from kvxferd.xfer.nixl.checks import board_rows
from kvxferd.xfer.rankmachine import RankMachine
from kvxferd.xfer.rankstate import RankTransfer
from kvxferd.xfer.samehost.hostmaps import MappedSource
from kvxferd.xfer.samehost.ranks import open_push_target
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import AdmittedRead, InFlightRead, ReadResult, ReadTimes


@dataclass(eq=False)
class PushTarget:
    """A connected target rank, seen from one writer rank: its plan and agent and, when this rank writes
    to it, the prepared lists (this cache's spans, the target's, the target's board). Keyed by the target
    rank as the rank machine's connection is (``local_lists`` ... ``host_ranks``)."""

    engine_id: str
    plans: dict[int, PushPlan]  # target rank -> plan, for every target rank this writer notifies
    agent_names: dict[int, str]
    local_lists: dict[int, object] = field(default_factory=dict)
    remote_lists: dict[int, object] = field(default_factory=dict)
    board_lists: dict[int, object] = field(default_factory=dict)
    board_buckets: dict[int, int] = field(default_factory=dict)
    host_ranks: dict = field(default_factory=dict)  # target rank -> HostRank: written by a copy here (same host)
    mapped: MappedSource | None = None  # the target's memory mapped here (same host), closed with the connection
    host_error: str = ""  # why a same-host target is written over NIXL ("": copied here, or not on this host)
    board_error: str = ""  # why a mapped target's board is checked over NIXL ("": mapped too)
    loaded: list = field(default_factory=list)  # (agent, remote name): one reference each, as connect took it
    # Its plan by layer with its own prepared lists, where that differs (layers stored inside a region: a span
    # of the whole write may run across layers); None: this connection's plan is by layer already.
    layered: "PushTarget | None" = None
    stageable: bool = True  # a push to it can go layer by layer (a plan by layer could be made)

    def by_layer(self) -> "PushTarget":
        """The connection a push written layer by layer posts its stages on."""
        return self if self.layered is None else self.layered


class PushExecutor:
    """Writes one local engine rank's blocks into target engines; built on that rank's read executor."""

    def __init__(self, reads: ReadExecutor) -> None:
        self.reads = reads
        self.agent, self.cache, self.notices, self.lock = reads.agent, reads.cache, reads.notices, reads.lock
        self.machine = RankMachine(reads.checks, WriteMover(reads.agent))
        # by (owner, target engine id, target rank): the owner is the peer identity that named the target (one
        # identity cannot replace another's target, nor point its pushes elsewhere)
        self.targets: dict[tuple[str, str, int], PushTarget] = {}
        self.abort_drain_s = reads.abort_drain_s
        self.num_notices_sent = 0

    # ---- connections -------------------------------------------------------
    def connect(self, target: EngineCache, metadata: bytes, board: BoardInfo, owner: str = "", *,
                same_host: bool = False) -> PushTarget | None:
        """Plan and prepare writes into one target rank (its cache, agent metadata and board) for ``owner``;
        None when this rank holds nothing that target rank needs. A bad target leaves nothing behind;
        the same owner connecting the same target rank again replaces its earlier connection. ``same_host``:
        the target proved it shares this host; its memory, where it named it, is mapped and copied into here
        (else, or when it cannot be mapped: :attr:`PushTarget.host_error`, written over NIXL)."""
        with self.lock:
            # Layers stored inside a region: the whole write keeps its coarser spans, stages take a plan by layer
            # of their own (none where one cannot be made: those pushes go in one batch, staged ones are refused).
            # Else the plan by layer is the plan (every region one layer: the same descriptors).
            inside = _layers_inside(self.cache) or _layers_inside(target)
            plan = PushPlan(self.cache, target, by_layer=not inside)
            if not plan.notifies:
                return None
            layered = _plan_by_layer(self.cache, target) if inside else plan
            d, key = target.tp_rank, (owner, target.engine_id, target.tp_rank)
            if key in self.targets:
                self.disconnect(key)
            connection = PushTarget(target.engine_id, {d: plan}, {})
            try:
                name = self.agent.add_remote(metadata, "target.agent_metadata")
                connection.agent_names[d] = name
                connection.loaded.append((self.agent, name))
                self.notices.add_remote(metadata, "target.agent_metadata")
                connection.loaded.append((self.notices, name))
                self.notices.connect_to(name)
                if plan.writes:
                    connection.local_lists[d] = self.agent.prep_local(plan.writer_rows, self.cache.mem_type)
                    connection.remote_lists[d] = self.agent.prep_remote(name, plan.target_rows, target.mem_type)
                    connection.board_lists[d] = self.agent.prep_remote(
                        name, board_rows(board.address, board.num_buckets), "DRAM")
                    connection.board_buckets[d] = board.num_buckets
                    if inside and layered is not None:
                        connection.layered = PushTarget(target.engine_id, {d: layered}, connection.agent_names,
                                                        board_lists=connection.board_lists,
                                                        board_buckets=connection.board_buckets)
                        connection.layered.local_lists[d] = self.agent.prep_local(layered.writer_rows,
                                                                                 self.cache.mem_type)
                        connection.layered.remote_lists[d] = self.agent.prep_remote(name, layered.target_rows,
                                                                                   target.mem_type)
                if same_host and plan.writes:
                    self._map(connection, d, target, board, plan, layered if inside else None)
            except BaseException:
                self._release(connection)
                raise
            connection.stageable = layered is not None
            self.targets[key] = connection
            return connection

    @staticmethod
    def _map(connection: PushTarget, d: int, target: EngineCache, board: BoardInfo, plan: PushPlan,
             layered: PushPlan | None) -> None:
        """Map a same-host target rank's memory for copies: the whole write's, and its stages' where they have a
        plan of their own (one mapping); a target that cannot be mapped is written over NIXL, saying why."""
        plans = [plan] if layered is None else [plan, layered]
        try:
            connection.mapped, ranks, connection.board_error = open_push_target(
                plan.writer, target, [p.copy_plan for p in plans], board)
        except TransferError as err:
            connection.host_error = err.message
            return
        connection.host_ranks[d] = ranks[0]
        if layered is not None:
            connection.layered.host_ranks[d] = ranks[1]

    def connect_engine(self, targets: Sequence[EngineCache], metadata: Sequence[bytes],
                       boards: Sequence[BoardInfo], owner: str = "", *, same_host: bool = False
                       ) -> dict[int, PushTarget]:
        """:meth:`connect` every rank of a target engine; the connections by target rank (those this rank
        notifies)."""
        if not len(targets) == len(metadata) == len(boards):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata and {len(boards)} boards for "
                                                   f"{len(targets)} target ranks")
        connected = {t.tp_rank: self.connect(t, m, b, owner, same_host=same_host)
                     for t, m, b in zip(targets, metadata, boards)}
        return {d: c for d, c in connected.items() if c is not None}

    def start_warm_up(self, target: PushTarget):
        """Post one READ of the target rank's board (the first check a push does): UCX sets the connection up
        on its first transfer (up to a second here), paid now instead of by the first push. The posted check
        (poll :meth:`warm_up_done`), or None when this rank writes nothing there."""
        with self.lock:
            d = next(iter(target.plans))
            if d not in target.board_lists:
                return None
            posted = self.reads.checks.post(target.board_lists[d], target.board_buckets[d], 1)
            return posted[0] if posted is not None else None

    def warm_up_done(self, check, *, give_up: bool = False) -> bool:
        """Whether the warm-up check ended (released then); True for None. ``give_up``: released anyway (its
        slot waits in the check area's quarantine until the READ ended)."""
        if check is None:
            return True
        with self.lock:
            if check.state() is TransferState.PROC and not give_up:
                return False
            check.release()
            return True

    def target(self, engine_id: str, target_rank: int, owner: str = "") -> PushTarget:
        """``owner``'s current connection to a target rank; :class:`NotFoundError` when there is none."""
        try:
            return self.targets[(owner, engine_id, target_rank)]
        except KeyError:
            raise NotFoundError("engine_id", f"no connection to rank {target_rank} of target engine "
                                             f"{engine_id!r}") from None

    def disconnect(self, key: tuple[str, str, int]) -> None:
        """Forget a target rank, by (owner, engine id, rank): its lists and agents."""
        with self.lock:
            target = self.targets.pop(key, None)
            if target is not None:
                self._release(target)

    def close(self) -> None:
        with self.lock:
            for key in list(self.targets):
                self.disconnect(key)

    def _release(self, target: PushTarget) -> None:
        layered = [] if target.layered is None else [target.layered.local_lists, target.layered.remote_lists]
        for lists in (target.local_lists, target.remote_lists, target.board_lists, *layered):
            for handle in lists.values():
                handle.release()
            lists.clear()
        if target.mapped is not None:  # (under the lock: no copy runs into it)
            target.mapped.close()
            target.mapped = None
            target.host_ranks.clear()
            if target.layered is not None:
                target.layered.host_ranks.clear()
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

    def post(self, target: PushTarget, planned: PlannedPush, start_s: float | None = None,
             write: RankRead | None = None, stage: bool = False) -> InFlightRead:
        """Post a planned push (its board check first); with ``stage``, only ``write`` (a stage of it, planned by
        layer on ``target.by_layer()``; None: nothing). A push that writes nothing (this rank only notifies, or
        an empty last stage) ends at once, ok."""
        with self.lock:
            write = write if stage else planned.write
            ranks = {} if write is None else {
                write.remote_rank: RankTransfer(write, hold_tag(planned.request.capability))}
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
        moves = [rank.move for rank in inflight.ranks.values()]  # the whole write, or the stage posted
        num_descriptors = sum(move.num_descriptors for move in moves)
        return ReadResult(planned.request.transfer_id, inflight.remote.engine_id, not errors,
                          0 if errors else sum(move.num_bytes for move in moves), num_descriptors,
                          time.perf_counter() - inflight.times.start_s, invalid, tuple(sorted(errors)),
                          error or None, inflight.failure, unsettled)

    # ---- notices -------------------------------------------------------------
    def send_notice(self, inflight: InFlightRead, target_rank: int) -> None:
        """Tell the target rank how this writer's part went, once its WRITE is over (nothing before the
        result). A notice says the WRITE is over: none when the drain gave up on a WRITE still running
        (the target then waits its push_settle_s); one after the expectation ended comes late and only
        tells the target its blocks are safe to give back (it carries that expectation's capability, so
        it counts for no later one)."""
        with self.lock:
            result = inflight.result
            if result is None or inflight.notified:
                return
            inflight.notified = True
            rank = inflight.ranks.get(target_rank)
            if result.unsettled:
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


def _layers_inside(cache: EngineCache) -> bool:
    """Whether a region of ``cache`` holds several layers (or says so unclearly: then no plan by layer is tried
    to be the plan)."""
    try:
        return any(n > group.num_regions for n, group in zip(cache.layer_counts, cache.groups))
    except KvxferError:
        return True


def _plan_by_layer(writer: EngineCache, target: EngineCache) -> PushPlan | None:
    """The plan by layer of a pair whose regions hold several layers; None when one cannot be made (a layout
    whose layers cannot be split apart): its pushes then go in one batch only."""
    try:
        return PushPlan(writer, target, by_layer=True)
    except KvxferError:
        return None
