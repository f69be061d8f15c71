"""Vectorised span emission for sets of block ids.

A :class:`SpanTable` stacks the per-block templates of ``R`` regions (e.g.
one per layer) that share block addressing. For block id pairs it emits
``R * num_blocks * T`` span pairs with three broadcast additions::

    offset[r, b, t] = region_template[r, t] + block_table[block_id[b]]

in region-major, block, template order, so runs of consecutive blocks that
are contiguous on both sides sit next to each other and merge into one span.
No Python loop runs per block or per region.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.errors import BlockIdError, InvalidArgumentError
from kvxferd.layout.match import PairTemplate, match_layouts
from kvxferd.layout.strided import Layout


@dataclass(frozen=True, eq=False)
class SpanPairs:
    """Equal-length local and remote spans: the i-th hold the same bytes."""

    local_offsets: np.ndarray  # [S] int64 bytes
    remote_offsets: np.ndarray  # [S] int64 bytes
    lengths: np.ndarray  # [S] int64 bytes

    @property
    def num_spans(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def concat(cls, parts: list["SpanPairs"]) -> "SpanPairs":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("local_offsets", "remote_offsets", "lengths")))


def check_block_ids(block_ids, num_blocks: int, field: str) -> np.ndarray:
    """Validate external block ids: 1-D integers in ``[0, num_blocks)``."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise InvalidArgumentError(field, f"must be a 1-D list of block ids, got shape {ids.shape}")
    if ids.size == 0:
        return ids.astype(np.int64)
    if ids.dtype.kind not in "iu":  # np.issubdtype costs ~5 us: a small request's whole check
        raise InvalidArgumentError(field, f"block ids must be integers, got dtype {ids.dtype}")
    # Two reductions on the hot path; only a bad request pays for finding its first bad id.
    if ids.min() < 0 or ids.max() >= num_blocks:
        bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
        i = int(bad[0])
        raise BlockIdError(f"{field}[{i}]", f"block id {int(ids[i])} out of range [0, {num_blocks}) ({bad.size} bad ids)")
    return ids.astype(np.int64, copy=False)


def merge_runs(local: np.ndarray, remote: np.ndarray, span_bytes: int, boundary_every: int = 0) -> SpanPairs:
    """Merge neighbouring equal-size spans contiguous on both sides.

    ``boundary_every``: never merge across multiples of this index (region
    boundaries, which may be separate memory registrations).
    """
    n = len(local)
    joins = np.diff(local) == span_bytes
    if boundary_every:
        joins[boundary_every - 1 :: boundary_every] = False
    # Scattered requests rarely join: skip the remote side and the gathers then.
    if joins.any():
        joins &= np.diff(remote) == span_bytes
    if not joins.any():
        return SpanPairs(local, remote, np.full(n, span_bytes, dtype=np.int64))
    starts = np.flatnonzero(~joins) + 1
    starts = np.concatenate((np.zeros(1, dtype=starts.dtype), starts))
    lengths = np.diff(starts, append=n) * span_bytes
    return SpanPairs(local[starts], remote[starts], lengths)


@dataclass(frozen=True, eq=False)
class SpanTable:
    """Per-block span templates of ``R`` regions sharing block addressing."""

    local_templates: np.ndarray  # [R, T] bytes: region base + in-block offset
    remote_templates: np.ndarray  # [R, T]
    span_bytes: int
    local_block_table: np.ndarray  # [num_local_blocks] bytes
    remote_block_table: np.ndarray  # [num_remote_blocks] bytes

    @classmethod
    def from_template(cls, template: PairTemplate, local_bases=(0,), remote_bases=(0,)) -> "SpanTable":
        """Stack one template over regions at the given base byte offsets."""
        local_bases = np.asarray(local_bases, dtype=np.int64)
        remote_bases = np.asarray(remote_bases, dtype=np.int64)
        if local_bases.shape != remote_bases.shape or local_bases.ndim != 1:
            raise InvalidArgumentError("bases", f"need equal 1-D local/remote bases, got {local_bases.shape} and {remote_bases.shape}")
        return cls(
            local_templates=local_bases[:, None] + template.local_offsets[None, :],
            remote_templates=remote_bases[:, None] + template.remote_offsets[None, :],
            span_bytes=template.span_bytes,
            local_block_table=template.local_block_table,
            remote_block_table=template.remote_block_table,
        )

    @property
    def num_regions(self) -> int:
        return self.local_templates.shape[0]

    @property
    def spans_per_block(self) -> int:
        return self.local_templates.shape[1]

    def spans(self, local_block_ids, remote_block_ids, *, merge: bool = True, merge_across_regions: bool = False) -> SpanPairs:
        """Span pairs reading ``remote_block_ids[i]`` into ``local_block_ids[i]``."""
        local_ids = check_block_ids(local_block_ids, len(self.local_block_table), "local_block_ids")
        remote_ids = check_block_ids(remote_block_ids, len(self.remote_block_table), "remote_block_ids")
        if len(local_ids) != len(remote_ids):
            raise InvalidArgumentError("block_ids", f"{len(local_ids)} local vs {len(remote_ids)} remote block ids")
        # [R, 1, T] + [1, nb, 1] -> [R, nb, T]
        local = (self.local_templates[:, None, :] + self.local_block_table[local_ids][None, :, None]).ravel()
        remote = (self.remote_templates[:, None, :] + self.remote_block_table[remote_ids][None, :, None]).ravel()
        if not merge:
            return SpanPairs(local, remote, np.full(len(local), self.span_bytes, dtype=np.int64))
        per_region = 0 if merge_across_regions else len(local_ids) * self.spans_per_block
        return merge_runs(local, remote, self.span_bytes, per_region)


def emit_spans(layout: Layout, block_ids, *, merge: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Byte spans ``(offsets, lengths)`` covering ``block_ids`` of one layout."""
    table = SpanTable.from_template(match_layouts(layout, layout))
    pairs = table.spans(block_ids, block_ids, merge=merge)
    return pairs.local_offsets, pairs.lengths
