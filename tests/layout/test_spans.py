"""Span emission: block id validation, merging, region stacking."""

import numpy as np
import pytest

from kvxferd.errors import BlockIdError, InvalidArgumentError
from kvxferd.layout.builders import contiguous
from kvxferd.layout.match import match_layouts
from kvxferd.layout.spans import SpanTable, emit_spans, merge_runs


def blocks(num_blocks=8):
    return contiguous(("B", "H", "N", "C"), (num_blocks, 2, 4, 8), "bfloat16")  # 128 B per block


def test_emit_spans_merges_contiguous_runs():
    offsets, lengths = emit_spans(blocks(), [2, 3, 4, 7, 0, 1])
    assert offsets.tolist() == [256, 896, 0] and lengths.tolist() == [384, 128, 256]
    offsets, lengths = emit_spans(blocks(), [2, 3, 4], merge=False)
    assert offsets.tolist() == [256, 384, 512] and lengths.tolist() == [128] * 3


def test_narrowed_heads_do_not_merge_across_blocks():
    layout = blocks().narrow("H", 1, 1)
    offsets, lengths = emit_spans(layout, [0, 1, 2])
    assert offsets.tolist() == [64, 192, 320] and lengths.tolist() == [64] * 3


@pytest.mark.parametrize(
    "ids, field",
    [([0, -1], "local_block_ids[1]"), ([8], "local_block_ids[0]"), ([[1, 2]], "local_block_ids"), ([0.5], "local_block_ids")],
)
def test_bad_block_ids_name_the_position(ids, field):
    table = SpanTable.from_template(match_layouts(blocks(), blocks()))
    with pytest.raises(InvalidArgumentError) as err:
        table.spans(ids, [0] * len(np.ravel(ids)))
    assert err.value.field == field
    if "[" in field[-3:]:
        assert isinstance(err.value, BlockIdError)


def test_remote_ids_are_checked_against_the_remote_cache():
    table = SpanTable.from_template(match_layouts(blocks(4), blocks(16)))
    assert table.spans([3], [15]).num_spans == 1
    with pytest.raises(BlockIdError) as err:
        table.spans([1], [16])
    assert err.value.field == "remote_block_ids[0]"
    with pytest.raises(InvalidArgumentError, match="2 local vs 1 remote"):
        table.spans([1, 2], [3])


def test_empty_request_emits_nothing():
    table = SpanTable.from_template(match_layouts(blocks(), blocks()))
    pairs = table.spans([], [])
    assert pairs.num_spans == 0 and pairs.num_bytes == 0


def test_regions_stack_and_do_not_merge_across_boundaries():
    template = match_layouts(blocks(), blocks())
    region_bytes = 8 * 128
    # Two layers back to back: the last block of layer 0 touches block 0 of layer 1.
    table = SpanTable.from_template(template, [0, region_bytes], [0, region_bytes])
    pairs = table.spans([6, 7], [6, 7])
    assert pairs.local_offsets.tolist() == [768, region_bytes + 768] and pairs.lengths.tolist() == [256, 256]
    # Order is (region, block): block 7 of layer 0 then block 0 of layer 1 touch.
    assert table.spans([0, 7], [0, 7]).lengths.tolist() == [128] * 4
    merged = table.spans([0, 7], [0, 7], merge_across_regions=True)
    assert merged.local_offsets.tolist() == [0, 896, 1920] and merged.lengths.tolist() == [128, 256, 128]


def test_merge_runs_requires_contiguity_on_both_sides():
    local = np.array([0, 10, 20, 30])
    remote = np.array([0, 10, 25, 35])
    pairs = merge_runs(local, remote, 10)
    assert pairs.local_offsets.tolist() == [0, 20] and pairs.lengths.tolist() == [20, 20]
