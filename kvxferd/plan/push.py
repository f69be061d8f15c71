"""The write direction (push, issue #57): what one prefill rank writes into one decode rank.

A push moves the same bytes as the pull it replaces: decode rank ``d`` needs
exactly the spans it would have read, from exactly the prefill ranks it
would have read them from (round-robin over replicas included). So the plan
is built from the *decode* rank's side, as its read plan, and the writer
keeps only its own rank's part with the two sides swapped::

    read plan of decode rank d  (local = d, remotes = prefill ranks 0..P-1)
        rank_plans[q]:  local rows  (d's spans)   <- remote rows (q's spans)
    push plan of prefill rank q into d
        writer rows  = rank_plans[q].remote rows   (registered here, q's cache)
        target rows  = rank_plans[q].local rows    (d's cache, on d's agent)

The writer knows only its own cache; the other prefill ranks' layouts follow
from it (every rank of an engine has one spec, only the rank differs), and
their addresses are never used. A prefill rank that holds data ``d`` needs
but is not the one picked to write it still *notifies* ``d`` (with nothing
written), so ``d`` counts the same set of writers as the holders it would
have notified after a read: :func:`writing_ranks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.match import DEFAULT_MAX_SPANS_PER_BLOCK
from kvxferd.plan.capability import check_capability_bytes
from kvxferd.plan.engine import EngineTransferPlan, RankPlan, RankRead, ReadRequest
from kvxferd.plan.groups import EngineCache, RegionMemory
from kvxferd.tp.reads import TpPairing


@dataclass(frozen=True)
class PushRequest:
    """Write a prefill hold's blocks into the blocks a decode rank expects.

    ``transfer_id`` names the expectation on the decode side (its hold of the
    decode blocks, sealed by ``capability``, minted by the decode rank);
    ``target_block_ids`` are the decode blocks per group (only those decode
    does not already hold), ``writer_block_ids`` the prefill hold's.
    """

    transfer_id: str
    target_block_ids: tuple  # one id sequence per group (decode side)
    writer_block_ids: tuple  # one id sequence per group (prefill side)
    capability: bytes  # the expectation's, minted by the target rank
    num_tokens: int | None = None  # needed only when block sizes differ

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise InvalidArgumentError("transfer_id", "must not be empty")
        check_capability_bytes(self.capability, "capability")


@dataclass(frozen=True, eq=False)
class PlannedPush:
    """One request's descriptor ids for one (writer rank, target rank) pair."""

    request: PushRequest
    write: RankRead | None  # None: this writer only notifies (another rank writes the data)
    target_units: tuple[np.ndarray, ...]  # per group, the target's units paired
    plan: "PushPlan"

    @property
    def num_bytes(self) -> int:
        return 0 if self.write is None else self.write.num_bytes

    def stage(self, layers_from, layers_to) -> RankRead | None:
        """The part of this push that writes layers ``[layers_from[g], layers_to[g])`` of every group ``g``
        (a plan by layer); None when it writes nothing. Stages over consecutive ranges of layers cover the
        whole write exactly once (vectorised: the selected regions' runs of descriptors, from per-region
        arrays made with the plan)."""
        if self.write is None:
            return None
        plan = self.plan
        if not plan.by_layer:
            raise InvalidArgumentError("layers", "this push was not planned layer by layer")
        lo, hi = _layer_bounds(layers_from, len(self.target_units)), _layer_bounds(layers_to, len(self.target_units))
        num_units = np.fromiter((len(u) for u in self.target_units), np.int64, len(self.target_units))
        sizes = num_units[plan.region_groups] * plan.region_spans  # descriptors of each (table, region), in order
        starts = np.cumsum(sizes) - sizes
        layer, group = plan.region_layers, plan.region_groups
        selected = np.flatnonzero((layer >= lo[group]) & (layer < hi[group]) & (sizes > 0))
        if not len(selected):
            return None
        # the selected regions' runs of descriptors, gathered without touching the others (a push's stages
        # together cost one pass over its descriptors)
        run_sizes = sizes[selected]
        total = int(run_sizes.sum())
        index = np.repeat(starts[selected] - (np.cumsum(run_sizes) - run_sizes), run_sizes) + np.arange(total)
        num_bytes = int((run_sizes * plan.region_span_bytes[selected]).sum())
        return RankRead(self.write.remote_rank, self.write.local_ids[index], self.write.remote_ids[index], num_bytes)

    def invalid_block_ids(self) -> tuple[np.ndarray, ...]:
        """Per group: target block ids this writer's failure leaves incomplete."""
        groups = self.plan.groups_written
        return tuple(np.unique(units // self.plan.read_plan.pairings[g].local_units_per_block) if g in groups
                     else np.zeros(0, dtype=np.int64) for g, units in enumerate(self.target_units))


class PushPlan:
    """What writer rank ``writer.tp_rank`` writes into target rank ``target.tp_rank`` (built once per pair)."""

    def __init__(self, writer: EngineCache, target: EngineCache, *,
                 max_spans_per_block: int = DEFAULT_MAX_SPANS_PER_BLOCK, by_layer: bool = False) -> None:
        writers = [writer if r == writer.tp_rank else peer_rank(writer, r) for r in range(writer.tp_size)]
        self.writer, self.target, self.by_layer = writer, target, by_layer
        self.read_plan = EngineTransferPlan(target, writers, max_spans_per_block=max_spans_per_block,
                                            by_layer=by_layer)
        q = writer.tp_rank
        self.rank_plan = next((rp for rp in self.read_plan.rank_plans if rp.remote_rank == q), None)
        # Per (table, region) of this writer's descriptors, in their order: group, layer, spans per unit and
        # span bytes (a stage of a push is the runs of the regions of its layers: PlannedPush.stage).
        tables = () if self.rank_plan is None else self.rank_plan.tables
        per_region = [len(t.local.id_templates) for t in tables]
        self.region_groups = np.repeat(np.array([t.group for t in tables], np.int64), per_region)
        self.region_layers = (np.concatenate([t.region_layers() for t in tables]) if tables
                              else np.zeros(0, np.int64))
        self.region_spans = np.repeat(np.array([t.local.id_templates.shape[1] for t in tables], np.int64), per_region)
        self.region_span_bytes = np.repeat(np.array([t.local.span_bytes for t in tables], np.int64), per_region)
        # Whether this writer must tell the target how it went (it holds data the target needs).
        self.notifies = q in self.read_plan.notify_ranks
        # How many writers the target hears from per request: the same count it computes itself.
        self.expected_writers = len(self.read_plan.notify_ranks)

    @property
    def writes(self) -> bool:
        """Whether this writer moves any bytes to the target (else it only notifies)."""
        return self.rank_plan is not None

    @property
    def groups_written(self) -> frozenset[int]:
        return frozenset() if self.rank_plan is None else self.rank_plan.groups

    @property
    def writer_rows(self) -> np.ndarray:
        """Strided rows of the writer's own cache (prepared locally)."""
        return self.rank_plan.remote_rows

    @property
    def target_rows(self) -> np.ndarray:
        """Strided rows of the target's cache (prepared on the target's agent)."""
        return self.rank_plan.local_rows

    @property
    def copy_plan(self) -> RankPlan:
        """This writer's part seen from the writer: its own cache's rows local, the target's remote (the tables a
        same-host copy into the target's memory expands)."""
        return dataclasses.replace(self.rank_plan, local_rows=self.writer_rows, remote_rows=self.target_rows)

    def plan_request(self, request: PushRequest) -> PlannedPush:
        """Descriptor ids of one push (vectorised; validates the ids as a read would)."""
        read = ReadRequest(request.transfer_id, request.transfer_id, request.target_block_ids,
                           request.writer_block_ids, request.num_tokens)
        planned = self.read_plan.plan_request(read)
        target_units = tuple(local for local, _ in planned.units)
        mine = next((r for r in planned.reads if r.remote_rank == self.writer.tp_rank), None)
        if mine is None:
            return PlannedPush(request, None, target_units, self)
        # The read's local side is the target, its remote side this writer: swap them.
        write = RankRead(self.target.tp_rank, mine.remote_ids, mine.local_ids, mine.num_bytes)
        return PlannedPush(request, write, target_units, self)


def _layer_bounds(layers, num_groups: int) -> np.ndarray:
    bounds = np.asarray(layers, dtype=np.int64)
    if bounds.shape != (num_groups,):
        raise InvalidArgumentError("layers", f"{bounds.shape} layer bounds for {num_groups} groups")
    return bounds


def peer_rank(cache: EngineCache, tp_rank: int) -> EngineCache:
    """Another rank of ``cache``'s engine as far as planning needs it: the same spec at ``tp_rank``. Its
    memory is a stand-in (address 0, the layout's size): a writer never addresses another rank's cache."""
    memory = tuple(tuple(RegionMemory(0, group.spec.region(cache.tp_size, tp_rank).num_bytes) for _ in regions)
                   for group, regions in zip(cache.groups, cache.memory))
    return dataclasses.replace(cache, tp_rank=tp_rank, memory=memory)


def writing_ranks(target: EngineCache, writer_tp_size: int) -> np.ndarray:
    """Per rank of a writer engine with ``writer_tp_size`` ranks: whether it notifies target rank
    ``target.tp_rank`` of every push (bool array); computed by the target from its own layout and the
    writer's introduced TP size, so a writer's notice cannot shrink the count.

    The same set as the notify ranks of the target's read plan (:attr:`PushPlan.expected_writers` counts them): the holders of any element
    the target needs, over every sharded piece of every group.
    """
    notify = np.zeros((target.tp_size, writer_tp_size), dtype=bool)
    for g in range(len(target.groups)):
        extents = tuple(f.global_extent for f in target.region(g).fields)
        notify |= TpPairing(target.tp_size, writer_tp_size, extents).notify_matrix
    return notify[target.tp_rank]


def expected_writers(target: EngineCache, writer_tp_size: int) -> int:
    """How many writer ranks notify ``target`` per push (:func:`writing_ranks`)."""
    return int(writing_ranks(target, writer_tp_size).sum())
