"""The transfer plan of one (local engine rank, remote engine) pair.

Built once at handshake from both sides' :class:`EngineCache`: for every
group it pairs the layouts (in units of the smaller block size), plans which
remote rank supplies which slice (TP mapping), and lays out, per remote
rank, the strided descriptor rows both sides prepare with NIXL::

    remote rank q:  local list  [ g0 field reads | g1 field reads | ... ]
                    remote list [ g0 field reads | g1 field reads | ... ]

Serving a request is then: pair block ids per group (vectorised), add them
to each table's id templates, concatenate per remote rank. There is no
branch on the model kind here: kinds only chose the pairing policy and the
layouts at build time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import InvalidArgumentError, TpConfigError
from kvxferd.layout.match import DEFAULT_MAX_SPANS_PER_BLOCK
from kvxferd.plan.descriptors import MAX_DESCRIPTOR_ID, DescriptorPair, SideDescriptors, count_merged
from kvxferd.plan.groups import EngineCache, GroupPairing, check_groups_compatible
from kvxferd.plan.reads import plan_region_reads
from kvxferd.tp.reads import TpPairing



@dataclass(frozen=True)
class ReadRequest:
    """Read ``remote_block_ids[g]`` of a remote request into ``local_block_ids[g]``."""

    request_id: str
    remote_request_id: str
    local_block_ids: tuple  # one id sequence per group
    remote_block_ids: tuple
    num_tokens: int | None = None  # needed only when block sizes differ
    remote_capabilities: tuple = ()  # per remote rank, its hold's (kvxferd.plan.capability)
    remote_digests: tuple = ()  # per remote rank, its hold's HoldDigests (kvxferd.plan.holddigests); () none


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Everything read from one remote rank: its tables and prepared rows."""

    remote_rank: int
    tables: tuple[DescriptorPair, ...]
    local_rows: np.ndarray  # [*, 5] strided rows, prepared once
    remote_rows: np.ndarray

    @property
    def groups(self) -> frozenset[int]:
        return frozenset(t.group for t in self.tables)


@dataclass(frozen=True, eq=False)
class RankRead:
    """One request's descriptors for one remote rank."""

    remote_rank: int
    local_ids: np.ndarray  # int32 indices into the rank's prepared local list
    remote_ids: np.ndarray
    num_bytes: int

    @property
    def num_descriptors(self) -> int:
        return len(self.local_ids)


@dataclass(frozen=True, eq=False)
class PlannedRead:
    """A request turned into per-rank descriptor ids, plus whom to notify."""

    request: ReadRequest
    reads: tuple[RankRead, ...]  # ranks with something to read
    notify_ranks: tuple[int, ...]  # every rank holding data of this request
    units: tuple[tuple[np.ndarray, np.ndarray], ...]  # per group: (local, remote) unit ids paired
    plan: "EngineTransferPlan"

    @property
    def num_bytes(self) -> int:
        return sum(r.num_bytes for r in self.reads)

    def invalid_block_ids(self, failed_ranks) -> tuple[np.ndarray, ...]:
        """Per group: local block ids left incomplete if ``failed_ranks`` failed."""
        failed = set(failed_ranks)
        out = []
        for g, (units, _) in enumerate(self.units):
            touched = any(g in rp.groups for rp in self.plan.rank_plans if rp.remote_rank in failed)
            k = self.plan.pairings[g].local_units_per_block
            out.append(np.unique(units // k) if touched else np.zeros(0, dtype=np.int64))
        return tuple(out)

    def count_merged_descriptors(self) -> int:
        """Descriptors after NIXL merges neighbours contiguous on both sides."""
        return sum(self.plan.count_merged(self, rank_read.remote_rank) for rank_read in self.reads)


class EngineTransferPlan:
    """Plan for local rank ``local`` reading from remote ranks ``remotes``."""

    def __init__(self, local: EngineCache, remotes: Sequence[EngineCache], *,
                 max_spans_per_block: int = DEFAULT_MAX_SPANS_PER_BLOCK, by_layer: bool = False) -> None:
        check_engines(local, remotes)
        self.local = local
        self.remotes = tuple(remotes)
        # by_layer: every table holds one layer of its regions (a push written layer by layer, issue #57)
        self.by_layer = by_layer
        self.pairings: list[GroupPairing] = []
        notify = np.zeros((local.tp_size, len(remotes)), dtype=bool)
        tables: dict[int, list[tuple]] = {}
        for g, group in enumerate(local.groups):
            pairing, reads = self._plan_group(g, max_spans_per_block)
            self.pairings.append(pairing)
            notify |= reads.pairing.notify_matrix
            for read in reads.reads:
                tables.setdefault(read.remote_rank, []).append((g, read))
        self.pairings = tuple(self.pairings)
        self.notify_ranks = tuple(np.flatnonzero(notify[local.tp_rank]).tolist())
        # Prefill rank q releases a request after this many readers notified it.
        self.expected_notifiers = {q: int(notify[:, q].sum()) for q in range(len(remotes))}
        self.rank_plans = tuple(self._rank_plan(q, tables[q]) for q in sorted(tables))
        # Per group, the bytes one local block reads when every unit of it is paired: a request's size is
        # bounded before it is planned (max_read_bytes).
        self.bytes_per_block = tuple(
            self.pairings[g].local_units_per_block * sum(t.descriptors_per_unit * t.local.span_bytes
                                                         for rp in self.rank_plans for t in rp.tables if t.group == g)
            for g in range(len(self.pairings)))

    @property
    def remote_engine_id(self) -> str:
        return self.remotes[0].engine_id

    def _plan_group(self, g: int, max_spans_per_block: int):
        group = self.local.groups[g]
        remote_group = self.remotes[0].groups[g]
        local_region, remote_region = self._region(self.local, g), self._region(self.remotes[0], g)
        pairing = GroupPairing(group.policy, group.block_size, remote_group.block_size,
                               local_region.num_blocks, remote_region.num_blocks)
        k_local, k_remote = pairing.local_units_per_block, pairing.remote_units_per_block
        reads = plan_region_reads(
            local_region.ungroup_blocks(k_local),
            [self._region(remote, g).ungroup_blocks(k_remote) for remote in self.remotes],
            self.local.tp_size, self.local.tp_rank, max_spans_per_block=max_spans_per_block,
        )
        return pairing, reads

    def _region(self, engine: EngineCache, g: int):
        region = engine.region(g)
        return region.by_layer() if self.by_layer else region

    def _side(self, engine: EngineCache, g: int, offsets, span_bytes, table, k, field) -> SideDescriptors:
        memory = engine.memory[g]
        return SideDescriptors.build([m.address for m in memory], [m.device_id for m in memory],
                                     offsets, span_bytes, table, k, field)

    def _rank_plan(self, q: int, reads) -> RankPlan:
        pairs, local_first, remote_first = [], 0, 0
        for g, read in reads:
            t = read.template
            field = f"groups[{g}].{read.field}"
            local = self._side(self.local, g, t.local_offsets, t.span_bytes, t.local_block_table,
                               self.pairings[g].local_units_per_block, field)
            remote = self._side(self.remotes[q], g, t.remote_offsets, t.span_bytes, t.remote_block_table,
                                self.pairings[g].remote_units_per_block, field)
            per_region = self.local.layer_counts[g] // self.local.groups[g].num_regions if self.by_layer else 1
            pairs.append(DescriptorPair(g, local, remote, local_first, remote_first, read.layer, per_region))
            local_first += local.num_descriptors
            remote_first += remote.num_descriptors
        if max(local_first, remote_first) > MAX_DESCRIPTOR_ID:
            raise InvalidArgumentError("num_blocks", f"{max(local_first, remote_first)} descriptors for remote rank {q} exceed NIXL's int32 ids")
        return RankPlan(q, tuple(pairs), np.concatenate([p.local.rows for p in pairs]),
                        np.concatenate([p.remote.rows for p in pairs]))

    def pair_units(self, request: ReadRequest) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group ``(local_units, remote_units)``; validates the request."""
        num_groups = len(self.pairings)
        for name in ("local_block_ids", "remote_block_ids"):
            if len(getattr(request, name)) != num_groups:
                raise InvalidArgumentError(name, f"{len(getattr(request, name))} groups given, engine has {num_groups}")
        restores_nothing = not any(len(ids) for ids in request.local_block_ids)
        return [p.pair_units(request.local_block_ids[g], request.remote_block_ids[g], request.num_tokens, f"groups[{g}]",
                             restores_nothing=restores_nothing)
                for g, p in enumerate(self.pairings)]

    def max_read_bytes(self, request: ReadRequest) -> int:
        """At least ``plan_request(request).num_bytes``, without planning or validating (a few µs)."""
        return sum(len(ids) * num_bytes for ids, num_bytes in zip(request.local_block_ids, self.bytes_per_block))

    def plan_request(self, request: ReadRequest) -> PlannedRead:
        """Descriptor ids per remote rank for one request (vectorised; no I/O)."""
        units = self.pair_units(request)
        reads = []
        for rank_plan in self.rank_plans:
            sizes = [len(units[t.group][0]) * t.descriptors_per_unit for t in rank_plan.tables]
            total = sum(sizes)
            if not total:
                continue
            # One output array per side, filled in place: no per-table concatenation.
            local_ids, remote_ids = np.empty(total, dtype=np.int32), np.empty(total, dtype=np.int32)
            position, num_bytes = 0, 0
            for table, size in zip(rank_plan.tables, sizes):
                if size:
                    local_units, remote_units = units[table.group]
                    table.local.ids_into(local_units, table.local_first, local_ids[position : position + size])
                    table.remote.ids_into(remote_units, table.remote_first, remote_ids[position : position + size])
                    num_bytes += size * table.local.span_bytes
                    position += size
            reads.append(RankRead(rank_plan.remote_rank, local_ids, remote_ids, num_bytes))
        return PlannedRead(request, tuple(reads), self.notify_ranks, tuple(units), self)

    def count_merged(self, planned: PlannedRead, remote_rank: int) -> int:
        """Merged descriptor count of one rank's read (addresses, not ids)."""
        rank_plan = next(rp for rp in self.rank_plans if rp.remote_rank == remote_rank)
        local, remote, lengths = [], [], []
        for table in rank_plan.tables:
            local_units, remote_units = planned.units[table.group]
            local.append(table.local.addresses(local_units))
            remote.append(table.remote.addresses(remote_units))
            lengths.append(np.full(len(local[-1]), table.local.span_bytes, dtype=np.int64))
        return count_merged(np.concatenate(local), np.concatenate(remote), np.concatenate(lengths))


def expected_readers(holder: EngineCache, reader_tp_size: int) -> int:
    """How many ranks of a reader engine with ``reader_tp_size`` ranks notify rank ``holder.tp_rank`` per request.

    The holder computes this from what it knows itself (its own layout, and
    the reader's TP size from the reader's authenticated introduction), so a
    notice cannot shrink the count and free blocks before every reader read
    them. It equals :attr:`EngineTransferPlan.expected_notifiers` of every
    reader rank's plan (the same union over groups of the TP notify sets).
    """
    return int(notifying_readers(holder, reader_tp_size).sum())


def notifying_readers(holder: EngineCache, reader_tp_size: int) -> np.ndarray:
    """Per rank of a reader engine with ``reader_tp_size`` ranks: whether it reads (or replicates) and so
    notifies rank ``holder.tp_rank`` (bool array). A reader rank outside it never reads this rank."""
    notify = np.zeros((reader_tp_size, holder.tp_size), dtype=bool)
    for g in range(len(holder.groups)):
        extents = tuple(f.global_extent for f in holder.region(g).fields)
        notify |= TpPairing(reader_tp_size, holder.tp_size, extents).notify_matrix
    return notify[:, holder.tp_rank]


def _check_remotes(remotes: Sequence[EngineCache]) -> None:
    if not remotes:
        raise InvalidArgumentError("remotes", "need the cache of every remote TP rank")
    engine_ids = {r.engine_id for r in remotes}
    if len(engine_ids) != 1:
        raise InvalidArgumentError("remotes", f"ranks of several engines given: {sorted(engine_ids)}")
    for q, remote in enumerate(remotes):
        if (remote.tp_rank, remote.tp_size) != (q, len(remotes)):
            raise TpConfigError(f"remotes[{q}].tp", f"rank {remote.tp_rank}/{remote.tp_size}, expected {q}/{len(remotes)}")
    for remote in remotes[1:]:
        check_groups_compatible(remotes[0], remote)


def check_engines(local: EngineCache, remotes: Sequence[EngineCache]) -> None:
    """Fail early, naming the field, when the engines cannot be paired."""
    _check_remotes(remotes)
    check_groups_compatible(local, remotes[0])
