"""Pair a local and a remote layout of the same logical data into spans.

Both layouts name the same dims with the same sizes (after TP narrowing);
their order in memory and their strides may differ. We look for the largest
run of elements that is contiguous, in the same logical order, on *both*
sides; every span then holds one such run, and the i-th local span and the
i-th remote span hold the same elements::

    local  HND (H=2, N=3, C)      remote NHD (N=3, H=2, C)
    h0: n0 n1 n2 | h1: n0 n1 n2   n0: h0 h1 | n1: h0 h1 | n2: h0 h1
    common run = one C row (H and N are ordered differently)
    -> 6 spans per block of C elements each

The per-block pattern (a *template*: the in-block byte offset of every span
on each side) is computed once; a block's spans are its base plus the
template, so span emission for many blocks is vectorised arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import LayoutMismatchError, SpanBudgetError
from kvxferd.layout.strided import BLOCK_DIM, Layout

DEFAULT_MAX_SPANS_PER_BLOCK = 4096


@dataclass(frozen=True, eq=False)
class PairTemplate:
    """Spans of one block on both sides, plus every block's base offset."""

    local_offsets: np.ndarray  # [T] bytes, in-block offset of each span (view offset included)
    remote_offsets: np.ndarray  # [T]
    span_bytes: int
    local_block_table: np.ndarray  # [num_local_blocks] bytes
    remote_block_table: np.ndarray  # [num_remote_blocks] bytes
    contiguous_dims: tuple[str, ...]  # dims whose every element lies inside one span

    @property
    def spans_per_block(self) -> int:
        return len(self.local_offsets)


def common_factors(dim: str, a: list[int], b: list[int]) -> list[int]:
    """Coarsest factor sizes (outer to inner) that refine both ``a`` and ``b``.

    Factors are mixed-radix digits; the boundaries are the products of the
    inner factors. A common refinement exists iff those products form a chain
    under divisibility::

        [4, 4] and [16]   -> [4, 4]
        [2, 3] and [3, 2] -> none (3 and 2 do not divide each other)
    """
    bounds = set()
    for sizes in (a, b):
        product = 1
        for size in reversed(sizes):
            product *= size
            bounds.add(product)
    ordered = sorted(bounds)
    for inner, outer in zip(ordered, ordered[1:]):
        if outer % inner:
            raise LayoutMismatchError(
                f"dims[{dim}]", f"factorisations {a} and {b} of dim {dim!r} have no common refinement"
            )
    steps = [outer // inner for inner, outer in zip([1] + ordered, ordered)]
    return list(reversed(steps))


def _check_same_data(local: Layout, remote: Layout) -> list[str]:
    if local.dtype != remote.dtype or local.itemsize != remote.itemsize:
        raise LayoutMismatchError("dtype", f"local {local.dtype} vs remote {remote.dtype}")
    for side, layout in (("local", local), ("remote", remote)):
        if BLOCK_DIM not in layout.dims:
            raise LayoutMismatchError("dims", f"{side} layout {layout.dims} has no block dim {BLOCK_DIM!r}")
    local_dims = [d for d in local.dims if d != BLOCK_DIM]
    remote_dims = [d for d in remote.dims if d != BLOCK_DIM]
    if set(local_dims) != set(remote_dims):
        only_local = sorted(set(local_dims) - set(remote_dims))
        only_remote = sorted(set(remote_dims) - set(local_dims))
        raise LayoutMismatchError("dims", f"only local: {only_local}, only remote: {only_remote}")
    differing = [f"{d}: {local.size(d)} vs {remote.size(d)}" for d in local_dims if local.size(d) != remote.size(d)]
    if differing:
        raise LayoutMismatchError("dims", "sizes differ (local vs remote): " + ", ".join(differing))
    return local_dims


def match_layouts(
    local: Layout, remote: Layout, *, max_spans_per_block: int = DEFAULT_MAX_SPANS_PER_BLOCK
) -> PairTemplate:
    """Pair two layouts of the same per-block data at the coarsest granularity.

    Raises :class:`LayoutMismatchError` naming the dims that differ, or
    :class:`SpanBudgetError` when more than ``max_spans_per_block`` spans per
    block would be needed.
    """
    dims = _check_same_data(local, remote)
    for dim in dims:
        sizes = common_factors(dim, [a.size for a in local.factors(dim)], [a.size for a in remote.factors(dim)])
        local, remote = local.refine(dim, sizes), remote.refine(dim, sizes)
    # Both sides now have the same (dim, factor) axes; pair them by position.
    pairs = [
        (la, ra)
        for dim in dims
        for la, ra in zip(local.factors(dim), remote.factors(dim))
        if la.size > 1
    ]
    pairs.sort(key=lambda p: p[0].stride)
    # Grow the run from the innermost axis while it is contiguous on both sides.
    run, inner = 1, 0
    while inner < len(pairs) and pairs[inner][0].stride == run and pairs[inner][1].stride == run:
        run *= pairs[inner][0].size
        inner += 1
    outer = pairs[inner:][::-1]  # outer to inner, in local memory order
    num_spans = math.prod(la.size for la, _ in outer)
    if num_spans > max_spans_per_block:
        la, ra = pairs[inner]
        raise SpanBudgetError(
            f"dims[{la.dim}]",
            f"{num_spans} spans of {run * local.itemsize} bytes per block exceed the budget of "
            f"{max_spans_per_block}: the common contiguous run stops at dim {la.dim!r} "
            f"(local stride {la.stride}, remote stride {ra.stride}, run {run}); "
            f"local {local}, remote {remote}",
        )
    local_offsets = np.full(1, local.offset, dtype=np.int64)
    remote_offsets = np.full(1, remote.offset, dtype=np.int64)
    for la, ra in outer:
        steps = np.arange(la.size, dtype=np.int64)
        local_offsets = (local_offsets[:, None] + steps * la.stride).ravel()
        remote_offsets = (remote_offsets[:, None] + steps * ra.stride).ravel()
    inner_dims = {la.dim for la, _ in pairs[:inner]} - {la.dim for la, _ in outer}
    return PairTemplate(
        local_offsets=local_offsets * local.itemsize,
        remote_offsets=remote_offsets * remote.itemsize,
        span_bytes=run * local.itemsize,
        local_block_table=local.block_table_bytes,
        remote_block_table=remote.block_table_bytes,
        contiguous_dims=tuple(d for d in dims if d in inner_dims or local.size(d) == 1),
    )
