"""Which remote ranks a local rank reads from, and whom it must notify.

For one sharded dim (global extent ``G``) with ``T_l`` local and ``T_r``
remote ranks, a local rank needs the elements it holds and reads each one
exactly once from a remote rank that holds it::

    G=8, remote T=2, local T=3
    remote   q0: 0 1 2 3         | q1: 4 5 6 7
    local    r0: 0 1 | r1: 2 3 4 | r2: 5 6 7
    reads    r1: (q0, [2,4)) (q1, [4,5))

When the remote dim is replicated (``G < T_r``) an element has several
holders; local rank ``r`` picks holder ``r % num_holders`` so that local ranks
needing the same element spread over the replicas round-robin. Every remote
rank holding any element a local rank needs is notified by that rank, read or
not: a replica nobody read must still learn that it may free its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvxferd.errors import TpConfigError
from kvxferd.tp.shards import check_extent, check_tp, holder_ranks, owned_range


@dataclass(frozen=True, slots=True)
class ReadSlice:
    """Read global elements ``[global_start, global_stop)`` from ``remote_rank``.

    ``local_start``/``remote_start`` are the offsets of ``global_start`` inside
    the local and the remote shard of the dim.
    """

    remote_rank: int
    global_start: int
    global_stop: int
    local_start: int
    remote_start: int

    @property
    def num_elements(self) -> int:
        return self.global_stop - self.global_start


def read_slices(global_extent: int, local_tp_size: int, local_rank: int, remote_tp_size: int) -> tuple[ReadSlice, ...]:
    """The slices local rank ``local_rank`` reads, in global element order."""
    check_extent(global_extent)
    check_tp(local_tp_size, local_rank, field="local_tp")
    check_tp(remote_tp_size, 0, field="remote_tp")
    lo, hi = owned_range(global_extent, local_tp_size, local_rank)
    elements = np.arange(lo, hi, dtype=np.int64)
    first, stop = holder_ranks(global_extent, remote_tp_size, elements)
    chosen = first + local_rank % (stop - first)
    # One slice per run of consecutive elements read from the same rank.
    breaks = np.flatnonzero(chosen[1:] != chosen[:-1]) + 1
    run_starts = np.concatenate(([0], breaks))
    run_stops = np.concatenate((breaks, [len(elements)]))
    slices = []
    for start_idx, stop_idx in zip(run_starts.tolist(), run_stops.tolist()):
        q = int(chosen[start_idx])
        g0, g1 = lo + start_idx, lo + stop_idx
        remote_lo, _ = owned_range(global_extent, remote_tp_size, q)
        slices.append(ReadSlice(q, g0, g1, g0 - lo, g0 - remote_lo))
    return tuple(slices)


def notify_range(global_extent: int, local_tp_size: int, local_rank: int, remote_tp_size: int) -> range:
    """Remote ranks holding any element local rank ``local_rank`` holds."""
    check_extent(global_extent)
    check_tp(local_tp_size, local_rank, field="local_tp")
    check_tp(remote_tp_size, 0, field="remote_tp")
    lo, hi = owned_range(global_extent, local_tp_size, local_rank)
    first, _ = holder_ranks(global_extent, remote_tp_size, np.array([lo]))
    _, stop = holder_ranks(global_extent, remote_tp_size, np.array([hi - 1]))
    return range(int(first[0]), int(stop[0]))


@dataclass(frozen=True)
class TpPairing:
    """TP facts for one (local TP size, remote TP size) pair over several dims.

    ``global_extents`` lists one extent per independently sharded piece of
    the cache (e.g. KV heads; or the Mamba x/B/C conv segments and SSM heads;
    ``1`` for a replicated cache such as MLA). Notifications are the union
    over all pieces.
    """

    local_tp_size: int
    remote_tp_size: int
    global_extents: tuple[int, ...]

    def __post_init__(self) -> None:
        check_tp(self.local_tp_size, 0, field="local_tp")
        check_tp(self.remote_tp_size, 0, field="remote_tp")
        if not self.global_extents:
            raise TpConfigError("global_extents", "at least one sharded piece is needed")
        for i, extent in enumerate(self.global_extents):
            check_extent(extent, field=f"global_extents[{i}]")

    @cached_property
    def notify_matrix(self) -> np.ndarray:
        """``[local_rank, remote_rank]`` is True when local must notify remote."""
        matrix = np.zeros((self.local_tp_size, self.remote_tp_size), dtype=bool)
        for r in range(self.local_tp_size):
            for extent in self.global_extents:
                ranks = notify_range(extent, self.local_tp_size, r, self.remote_tp_size)
                matrix[r, ranks.start : ranks.stop] = True
        return matrix

    def notify_ranks(self, local_rank: int) -> tuple[int, ...]:
        """Remote ranks local rank ``local_rank`` notifies after its reads."""
        check_tp(self.local_tp_size, local_rank, field="local_tp")
        return tuple(np.flatnonzero(self.notify_matrix[local_rank]).tolist())

    def num_notifiers(self, remote_rank: int) -> int:
        """How many local ranks notify remote rank ``remote_rank`` per request."""
        check_tp(self.remote_tp_size, remote_rank, field="remote_tp")
        return int(self.notify_matrix[:, remote_rank].sum())

    def read_slices(self, piece: int, local_rank: int) -> tuple[ReadSlice, ...]:
        """Read slices of sharded piece ``piece`` for local rank ``local_rank``."""
        return read_slices(self.global_extents[piece], self.local_tp_size, local_rank, self.remote_tp_size)
