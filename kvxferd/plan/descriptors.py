"""Prepared descriptor lists and the arithmetic from unit ids to descriptor ids.

One side (local or remote) of one field read over ``R`` regions is a set of
NIXL descriptors, one per (region, template span, unit). They are prepared
once as *strided rows* ``(address, length, device, stride, count)``: a row
walks the outer block factor, so preparing costs one row per (region, span,
inner unit) whatever the number of blocks::

    unit u = (outer b, inner j)             (j: unit inside a larger block)
    row (r, t, j) = address base[r] + span[t] + inner[j], stride S_outer, count B
    descriptor id (r, t, u) = first + ((r*T + t)*K + j)*B + b
                            = id_templates[r, t] + keys[u]

A request's ids are then one broadcast addition in (region, unit, span)
order, the same order as :class:`~kvxferd.layout.spans.SpanTable`, so runs
of units contiguous on both sides sit next to each other and NIXL merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError

MAX_DESCRIPTOR_ID = 2**31 - 1  # NIXL takes int32 descriptor indices


@dataclass(frozen=True, eq=False)
class SideDescriptors:
    """One side of one field read: strided rows plus id and address arithmetic."""

    rows: np.ndarray  # [R*T*K, 5] uint64: address, length, device, stride, count
    id_templates: np.ndarray  # [R, T] int32 descriptor id of (r, t, unit 0), before ``first``
    address_templates: np.ndarray  # [R, T] int64 absolute address of (r, t, unit 0)
    unit_offsets: np.ndarray  # [U] bytes: offset of every unit from unit 0
    num_outer: int  # B: count of each row
    units_per_outer: int  # K
    span_bytes: int

    @classmethod
    def build(cls, bases, device_ids, span_offsets, span_bytes: int, unit_table, units_per_outer: int, field: str):
        """Rows for regions at ``bases`` with per-unit offsets ``unit_table``."""
        bases = np.asarray(bases, dtype=np.int64)
        unit_table = np.asarray(unit_table, dtype=np.int64)
        span_offsets = np.asarray(span_offsets, dtype=np.int64)
        k = units_per_outer
        if len(unit_table) % k:
            raise LayoutMismatchError(field, f"{len(unit_table)} units are not a multiple of {k} per block")
        num_outer = len(unit_table) // k
        inner = unit_table[:k] - unit_table[0]
        stride = int(unit_table[k] - unit_table[0]) if num_outer > 1 else span_bytes
        expected = unit_table[0] + (np.arange(num_outer, dtype=np.int64)[:, None] * stride + inner[None, :]).ravel()
        if not np.array_equal(unit_table, expected):
            raise LayoutMismatchError(field, "block addresses are not an evenly strided sequence of blocks")
        if num_outer > 1 and stride < span_bytes:
            raise LayoutMismatchError(field, f"blocks {stride} bytes apart overlap spans of {span_bytes} bytes")
        num_regions, num_spans = len(bases), len(span_offsets)
        address_templates = bases[:, None] + span_offsets[None, :] + unit_table[0]  # [R, T]
        starts = (address_templates[:, :, None] + inner[None, None, :]).ravel()  # row order (r, t, j)
        rows = np.empty((len(starts), 5), dtype=np.uint64)
        rows[:, 0] = starts
        rows[:, 1] = span_bytes
        rows[:, 2] = np.repeat(np.asarray(device_ids, dtype=np.uint64), num_spans * k)
        rows[:, 3] = stride
        rows[:, 4] = num_outer
        id_templates = (np.arange(num_regions * num_spans, dtype=np.int64) * (k * num_outer)).reshape(num_regions, num_spans)
        if rows.shape[0] * num_outer > MAX_DESCRIPTOR_ID:
            raise InvalidArgumentError("num_blocks", f"{rows.shape[0] * num_outer} descriptors exceed NIXL's int32 ids")
        return cls(rows, id_templates.astype(np.int32), address_templates, unit_table - unit_table[0], num_outer, k, span_bytes)

    @property
    def num_descriptors(self) -> int:
        return len(self.rows) * self.num_outer

    def keys(self, units: np.ndarray) -> np.ndarray:
        """Per-unit part of the descriptor id (int32, like NIXL's indices)."""
        units = units.astype(np.int32, copy=False)
        if self.units_per_outer == 1:
            return units
        return (units % self.units_per_outer) * np.int32(self.num_outer) + units // self.units_per_outer

    def ids_into(self, units: np.ndarray, first: int, out: np.ndarray) -> None:
        """Write the descriptor ids of every (region, unit, span), in that order, into ``out``."""
        keys = self.keys(units) + np.int32(first)
        np.add(self.id_templates[:, None, :], keys[None, :, None], out=out.reshape(len(self.id_templates), len(units), -1))

    def ids(self, units: np.ndarray, first: int) -> np.ndarray:
        """Descriptor ids of every (region, unit, span), in that order."""
        out = np.empty(self.id_templates.size * len(units), dtype=np.int32)
        self.ids_into(units, first, out)
        return out

    def addresses(self, units: np.ndarray) -> np.ndarray:
        """Start addresses of the same descriptors (for counting merged runs)."""
        return (self.address_templates[:, None, :] + self.unit_offsets[units][None, :, None]).ravel()


@dataclass(frozen=True, eq=False)
class DescriptorPair:
    """Both sides of one field read of one group from one remote rank."""

    group: int
    local: SideDescriptors
    remote: SideDescriptors
    local_first: int  # id of this table's first descriptor in the rank's local list
    remote_first: int
    layer: int = 0  # of its region's layers, the one it holds (a plan by layer); region r's is r * per_region + layer
    layers_per_region: int = 1

    def region_layers(self) -> np.ndarray:
        """The group's layer index of each of this table's regions (its descriptors run region by region)."""
        num_regions = len(self.local.id_templates)
        return np.arange(num_regions, dtype=np.int64) * self.layers_per_region + self.layer

    @property
    def descriptors_per_unit(self) -> int:
        return self.local.id_templates.size


def count_merged(local_addresses: np.ndarray, remote_addresses: np.ndarray, span_bytes: np.ndarray) -> int:
    """Descriptors left after merging neighbours contiguous on both sides."""
    if len(local_addresses) < 2:
        return len(local_addresses)
    ends_local = local_addresses[:-1] + span_bytes[:-1]
    joins = (ends_local == local_addresses[1:]) & (remote_addresses[:-1] + span_bytes[:-1] == remote_addresses[1:])
    return int(len(local_addresses) - np.count_nonzero(joins))


def expand_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(addresses, lengths)`` of every descriptor of strided ``rows``."""
    rows = rows.astype(np.int64)
    counts = rows[:, 4]
    row_of = np.repeat(np.arange(len(rows)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows[row_of, 0] + within * rows[row_of, 3], rows[row_of, 1]


@dataclass(frozen=True, eq=False)
class RowIndex:
    """Descriptor ids -> ``(addresses, lengths)`` of strided ``rows``, for a few ids at a time (a read's),
    without expanding every descriptor: one ``searchsorted`` over the rows (a few per region and span)."""

    rows: np.ndarray  # [*, 5] int64: (address, length, device, stride, count)
    first_ids: np.ndarray  # id of each row's first descriptor

    @classmethod
    def of(cls, rows: np.ndarray) -> "RowIndex":
        rows = np.asarray(rows, np.int64)
        counts = rows[:, 4]
        return cls(rows, np.cumsum(counts) - counts)

    @property
    def num_descriptors(self) -> int:
        return int(self.rows[:, 4].sum()) if len(self.rows) else 0

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(addresses, lengths)`` of descriptors ``ids`` (each in ``[0, num_descriptors)``)."""
        ids = np.asarray(ids, np.int64)
        row = np.searchsorted(self.first_ids, ids, side="right") - 1
        return self.rows[row, 0] + (ids - self.first_ids[row]) * self.rows[row, 3], self.rows[row, 1]
