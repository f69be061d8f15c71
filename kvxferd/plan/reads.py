"""What one local rank reads from each remote rank of one cache region.

Joins the TP mapping (which global elements come from which remote rank)
with the layout algebra (which bytes hold them on each side): for every
field and every read slice, narrow both views to the slice and pair them::

    local rank r, field "kv" (shard H)
      slice (q0, heads [2,4)) -> narrow local H[0:2], remote q0 H[2:4] -> template
      slice (q1, heads [4,5)) -> narrow local H[2:3], remote q1 H[0:1] -> template

Built once per (local region, remote engine); emitting spans for a request
is then vectorised arithmetic per (remote rank, field) table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError, TpConfigError
from kvxferd.layout.match import DEFAULT_MAX_SPANS_PER_BLOCK, PairTemplate, match_layouts
from kvxferd.layout.region import Field, Region
from kvxferd.layout.spans import SpanPairs, SpanTable
from kvxferd.tp.reads import ReadSlice, TpPairing, read_slices
from kvxferd.tp.shards import check_tp


@dataclass(frozen=True, eq=False)
class FieldRead:
    """Read one slice of one field from one remote rank."""

    remote_rank: int
    field: str
    slice: ReadSlice
    template: PairTemplate  # per-block pattern; stack it over many regions with SpanTable
    layer: int = 0  # the layer inside the region the field holds (a region split by layer), else 0

    @cached_property
    def table(self) -> SpanTable:
        """The template as a table of this one region."""
        return SpanTable.from_template(self.template)


@dataclass(frozen=True, eq=False)
class RegionReads:
    """All reads of one local rank for one region, plus whom to notify."""

    local_rank: int
    reads: tuple[FieldRead, ...]
    notify_ranks: tuple[int, ...]
    pairing: TpPairing

    @property
    def read_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r.remote_rank for r in self.reads}))

    def spans(self, local_block_ids, remote_block_ids, *, merge: bool = True) -> dict[int, SpanPairs]:
        """Span pairs per remote rank for one request's block ids."""
        per_rank: dict[int, list[SpanPairs]] = {}
        for read in self.reads:  # a few (rank, field) tables; never per block
            per_rank.setdefault(read.remote_rank, []).append(
                read.table.spans(local_block_ids, remote_block_ids, merge=merge)
            )
        return {rank: SpanPairs.concat(parts) for rank, parts in per_rank.items()}


def _narrow(field: Field, start: int, length: int):
    return field.layout if field.shard is None else field.layout.narrow(field.shard.dim, start, length)


def _check_fields(local: Region, remote: Region, remote_rank: int, remote_tp_size: int) -> None:
    local_names = [f.name for f in local.fields]
    remote_names = [f.name for f in remote.fields]
    if local_names != remote_names:
        raise LayoutMismatchError(f"remote[{remote_rank}].fields", f"local fields {local_names} vs remote {remote_names}")
    for lf, rf in zip(local.fields, remote.fields):
        lshard = None if lf.shard is None else (lf.shard.dim, lf.shard.global_extent)
        rshard = None if rf.shard is None else (rf.shard.dim, rf.shard.global_extent)
        if lshard != rshard:
            raise LayoutMismatchError(f"remote[{remote_rank}].fields[{lf.name}].shard", f"local {lshard} vs remote {rshard}")
    _check_built_for(remote, remote_tp_size, remote_rank, f"remote[{remote_rank}].tp_rank")


def _check_built_for(region: Region, tp_size: int, tp_rank: int, field: str) -> None:
    """Every sharded field of ``region`` must be rank ``tp_rank`` of ``tp_size``."""
    for f in region.fields:
        if f.shard is not None and (f.shard.tp_rank, f.shard.tp_size) != (tp_rank, tp_size):
            raise TpConfigError(field, f"field {f.name} was built for rank {f.shard.tp_rank}/{f.shard.tp_size}, "
                                       f"expected {tp_rank}/{tp_size}")


def plan_region_reads(
    local: Region,
    remotes: Sequence[Region],
    local_tp_size: int,
    local_rank: int,
    *,
    max_spans_per_block: int = DEFAULT_MAX_SPANS_PER_BLOCK,
) -> RegionReads:
    """Plan local rank ``local_rank``'s reads of ``remotes`` (one per remote rank)."""
    check_tp(local_tp_size, local_rank, field="local_tp")
    if not remotes:
        raise InvalidArgumentError("remotes", "need one remote region per remote TP rank")
    _check_built_for(local, local_tp_size, local_rank, "local.tp")
    for q, remote in enumerate(remotes):
        _check_fields(local, remote, q, len(remotes))
    reads = []
    for i, field in enumerate(local.fields):
        for piece in read_slices(field.global_extent, local_tp_size, local_rank, len(remotes)):
            remote_field = remotes[piece.remote_rank].fields[i]
            template = match_layouts(
                _narrow(field, piece.local_start, piece.num_elements),
                _narrow(remote_field, piece.remote_start, piece.num_elements),
                max_spans_per_block=max_spans_per_block,
            )
            reads.append(FieldRead(piece.remote_rank, field.name, piece, template, field.layer))
    pairing = TpPairing(local_tp_size, len(remotes), tuple(f.global_extent for f in local.fields))
    return RegionReads(local_rank, tuple(reads), pairing.notify_ranks(local_rank), pairing)
