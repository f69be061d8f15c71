"""The oracle must catch every kind of misplaced byte, and say where."""

import numpy as np
import pytest

from kvxferd.layout.spans import SpanPairs
from kvxferd.layout.specs import AttentionSpec, MambaSpec
from kvxferd.plan.reads import plan_region_reads
from kvxferd.rig.verify.oracle import BlockSource, apply_span_copies, expected_region, first_mismatch, tagged_region

SPECS = [
    AttentionSpec("packed_NHD", num_blocks=6, num_kv_heads=6, head_size=4, block_size=4, kernel_block_size=2),
    MambaSpec(num_blocks=6, num_heads=6, head_dim=2, num_groups=1, state_size=3, conv_window=3),
]
MUTATIONS = ["none", "shift_remote", "swap_blocks", "drop_span", "wrong_rank", "extra_write"]


@pytest.mark.parametrize("spec", SPECS, ids=["attention", "mamba"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutated_copies_are_caught(spec, mutation):
    p, d, r = 2, 3, 1
    bufs = [tagged_region(spec, p, q) for q in range(p)]
    reads = plan_region_reads(spec.region(d, r), [spec.region(p, q) for q in range(p)], d, r)
    local_ids, remote_ids = [1, 2], [3, 4]
    expected = expected_region(spec, d, r, BlockSource(local_ids, remote_ids, spec.num_blocks))
    buf = np.full(len(expected), 0xA5, dtype=np.uint8)
    spans = reads.spans(local_ids, remote_ids[::-1] if mutation == "swap_blocks" else remote_ids)
    for q, pairs in spans.items():
        if mutation == "shift_remote":
            pairs = SpanPairs(pairs.local_offsets, pairs.remote_offsets + 1, pairs.lengths)
        if mutation == "drop_span":
            pairs = SpanPairs(pairs.local_offsets[1:], pairs.remote_offsets[1:], pairs.lengths[1:])
        if mutation == "extra_write":
            pairs = SpanPairs(pairs.local_offsets - pairs.lengths[0], pairs.remote_offsets, pairs.lengths)
        apply_span_copies(bufs[(q + 1) % p if mutation == "wrong_rank" else q], buf, pairs)
    problem = first_mismatch(spec, d, r, buf, expected)
    if mutation == "none":
        assert problem is None
    else:
        assert problem is not None and "wrong bytes on rank 1/3" in problem
        assert ("coords" in problem) or ("padding" in problem)
