"""Apply a planned read with numpy, reading descriptors the way NIXL does.

The strided rows of a rank plan are expanded to one ``(address, length)``
per descriptor id (row ``i`` holds ids ``i*count .. i*count+count-1``), the
request's ids pick descriptors on both sides, and bytes are copied between
the engines' arenas. Pure and fast: it lets the plan be swept exhaustively;
the NIXL tests then move the same descriptors for real.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxferd.layout.spans import SpanPairs
from kvxferd.plan.descriptors import expand_rows
from kvxferd.plan.engine import PlannedRead
from kvxferd.plan.push import PlannedPush
from kvxferd.rig.verify.buffers import EngineBuffers
from kvxferd.rig.verify.oracle import apply_span_copies


def apply_planned_read(planned: PlannedRead, local: EngineBuffers, remotes: Sequence[EngineBuffers]) -> int:
    """Copy every descriptor of ``planned``; returns the bytes copied."""
    copied = 0
    rank_plans = {rp.remote_rank: rp for rp in planned.plan.rank_plans}
    for read in planned.reads:
        rank_plan = rank_plans[read.remote_rank]
        local_addr, local_len = expand_rows(rank_plan.local_rows)
        remote_addr, remote_len = expand_rows(rank_plan.remote_rows)
        if not np.array_equal(local_len[read.local_ids], remote_len[read.remote_ids]):
            raise ValueError(f"rank {read.remote_rank}: paired descriptors differ in length")
        remote = remotes[read.remote_rank]
        pairs = SpanPairs(local_addr[read.local_ids] - local.base_address,
                          remote_addr[read.remote_ids] - remote.base_address, local_len[read.local_ids])
        apply_span_copies(remote.arena, local.arena, pairs)
        copied += pairs.num_bytes
    return copied


def apply_planned_push(planned: PlannedPush, writer: EngineBuffers, target: EngineBuffers, write=None) -> int:
    """Copy every descriptor one writer rank's push moves into one target rank (or only ``write``'s: a stage
    of it, :meth:`PlannedPush.stage`); returns the bytes copied."""
    write = planned.write if write is None else write
    if write is None:
        return 0
    writer_addr, writer_len = expand_rows(planned.plan.writer_rows)
    target_addr, target_len = expand_rows(planned.plan.target_rows)
    if not np.array_equal(writer_len[write.local_ids], target_len[write.remote_ids]):
        raise ValueError(f"writer rank {writer.cache.tp_rank}: paired descriptors differ in length")
    pairs = SpanPairs(target_addr[write.remote_ids] - target.base_address,
                      writer_addr[write.local_ids] - writer.base_address, writer_len[write.local_ids])
    apply_span_copies(writer.arena, target.arena, pairs)
    return pairs.num_bytes
