"""Which tensor-parallel rank holds which elements of a sharded dim.

A sharded dim of global extent ``G`` over ``T`` ranks::

    G >= T (split):      rank r owns [r*G//T, (r+1)*G//T)     (sizes differ by <= 1)
    G <  T (replicated): rank r holds the single element r*G//T

    G=8, T=3   r0: 0 1 | r1: 2 3 4 | r2: 5 6 7
    G=2, T=4   r0: 0   | r1: 0     | r2: 1     | r3: 1

An unsharded cache (MLA) is the replicated case with ``G = 1``: every rank
holds the one (virtual) element. Pure integer arithmetic, no I/O.
"""

from __future__ import annotations

import numpy as np

from kvxferd.errors import TpConfigError

MAX_TP_SIZE = 1024


def check_tp(tp_size: int, tp_rank: int, *, field: str = "tp") -> None:
    """Raise :class:`TpConfigError` unless ``0 <= tp_rank < tp_size``."""
    if not isinstance(tp_size, (int, np.integer)) or not 1 <= tp_size <= MAX_TP_SIZE:
        raise TpConfigError(f"{field}_size", f"must be an integer in 1..{MAX_TP_SIZE}, got {tp_size!r}")
    if not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < tp_size:
        raise TpConfigError(f"{field}_rank", f"must be in 0..{tp_size - 1} for {field}_size={tp_size}, got {tp_rank!r}")


def check_extent(global_extent: int, *, field: str = "global_extent") -> None:
    """Raise :class:`TpConfigError` unless the sharded extent is a positive int."""
    if not isinstance(global_extent, (int, np.integer)) or global_extent < 1:
        raise TpConfigError(field, f"must be a positive integer, got {global_extent!r}")


def owned_range(global_extent: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global ``[start, stop)`` of the elements rank ``tp_rank`` holds."""
    check_extent(global_extent)
    check_tp(tp_size, tp_rank)
    start = tp_rank * global_extent // tp_size
    if global_extent < tp_size:
        return start, start + 1
    return start, (tp_rank + 1) * global_extent // tp_size


def holder_ranks(global_extent: int, tp_size: int, elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``[first, stop)`` ranks holding each global element.

    Split dims have one owner per element; replicated dims have every rank
    ``q`` with ``q*G//T == e``, which is a contiguous rank range.
    """
    e = np.asarray(elements, dtype=np.int64)
    g, t = int(global_extent), int(tp_size)
    if g >= t:
        owner = ((e + 1) * t - 1) // g
        return owner, owner + 1
    first = (e * t + g - 1) // g
    stop = ((e + 1) * t + g - 1) // g
    return first, stop
