"""One prefill -> decode pairing checked end to end with in-memory copies.

Builds every prefill rank's region (tagged) and every decode rank's region
(sentinel), plans each decode rank's reads with the layout algebra and TP
mapping, applies the span copies with numpy, and compares every decode byte
with the oracle. No NIXL here: this proves the *plan*; the data-plane tests
move the same spans with NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvxferd.layout.match import DEFAULT_MAX_SPANS_PER_BLOCK
from kvxferd.layout.specs import CacheSpec
from kvxferd.plan.reads import RegionReads, plan_region_reads
from kvxferd.rig.verify.oracle import BlockSource, apply_span_copies, expected_region, first_mismatch, tagged_region
from kvxferd.rig.verify.physical import SENTINEL, region_num_bytes


@dataclass
class ScenarioResult:
    """Outcome of one pairing; ``mismatches`` is empty when byte-exact."""

    verified_bytes: int = 0
    copied_bytes: int = 0
    num_spans: int = 0
    num_spans_unmerged: int = 0
    mismatches: list[str] = field(default_factory=list)
    reads: list[RegionReads] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def run_scenario(
    prefill_spec: CacheSpec,
    decode_spec: CacheSpec,
    prefill_tp: int,
    decode_tp: int,
    decode_block_ids,
    prefill_block_ids,
    *,
    max_spans_per_block: int = DEFAULT_MAX_SPANS_PER_BLOCK,
) -> ScenarioResult:
    """Read ``prefill_block_ids[i]`` into ``decode_block_ids[i]`` on every decode rank."""
    result = ScenarioResult()
    prefill_regions = [prefill_spec.region(prefill_tp, q) for q in range(prefill_tp)]
    prefill_bufs = [tagged_region(prefill_spec, prefill_tp, q) for q in range(prefill_tp)]
    for q, region in enumerate(prefill_regions):
        if region.num_bytes != len(prefill_bufs[q]):
            result.mismatches.append(f"prefill rank {q}: layout says {region.num_bytes} bytes, engine allocates {len(prefill_bufs[q])}")
    for r in range(decode_tp):
        region = decode_spec.region(decode_tp, r)
        buf = np.full(region_num_bytes(decode_spec, decode_tp, r), SENTINEL, dtype=np.uint8)
        if region.num_bytes != len(buf):
            result.mismatches.append(f"decode rank {r}: layout says {region.num_bytes} bytes, engine allocates {len(buf)}")
            continue
        reads = plan_region_reads(region, prefill_regions, decode_tp, r, max_spans_per_block=max_spans_per_block)
        result.reads.append(reads)
        writes = np.zeros(len(buf), dtype=np.int32)
        unmerged = reads.spans(decode_block_ids, prefill_block_ids, merge=False)
        for q, pairs in reads.spans(decode_block_ids, prefill_block_ids).items():
            apply_span_copies(prefill_bufs[q], buf, pairs, writes)
            result.num_spans += pairs.num_spans
            result.num_spans_unmerged += unmerged[q].num_spans
            result.copied_bytes += pairs.num_bytes
        if writes.max(initial=0) > 1:
            result.mismatches.append(f"decode rank {r}: {int((writes > 1).sum())} bytes written more than once")
        expected = expected_region(decode_spec, decode_tp, r, BlockSource(decode_block_ids, prefill_block_ids, decode_spec.num_blocks))
        problem = first_mismatch(decode_spec, decode_tp, r, buf, expected)
        if problem:
            result.mismatches.append(problem)
        result.verified_bytes += len(buf)
    return result
