"""The oracle for failed reads: every wrong byte must lie in a block the completion named invalid."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.rig.verify.buffers import allocate_engine, blocks_mask, check_failed_read, expected_buffers
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups, random_request
from kvxferd.rig.verify.oracle import BlockSource, expected_region
from kvxferd.rig.verify.physical import SENTINEL


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ["packed", "nhd", "legacy"])
def test_blocks_mask_is_exactly_the_bytes_a_block_receives(model, layout):
    """Brute force: the bytes that change when only block b is read are the bytes the mask gives b."""
    shape = ModelShape(num_blocks=6, block_size=8, kernel_block_size=4 if model != "mla" else None, layout=layout)
    _, decode_groups = model_groups(model, shape)
    for group in decode_groups:
        for b in range(group.spec.num_blocks):
            touched = expected_region(group.spec, 2, 1, BlockSource([b], [b], group.spec.num_blocks)) != SENTINEL
            mask = blocks_mask(group.spec, 2, 1, [b])
            assert not (touched & ~mask).any()  # every byte block b receives is in its mask
            others = blocks_mask(group.spec, 2, 1, [x for x in range(group.spec.num_blocks) if x != b])
            assert not (mask & others).any()  # and no byte belongs to two blocks


def _failed_read(model="swa"):
    prefill_groups, decode_groups = model_groups(model, ModelShape(num_blocks=16))
    request = random_request("r", prefill_groups, decode_groups, 64, np.random.default_rng(0))
    engine = allocate_engine("d", decode_groups, 1, 0, tagged=False)
    for actual_group, want_group in zip(engine.buffers, expected_buffers(engine.cache, prefill_groups, request)):
        for actual, want in zip(actual_group, want_group):
            actual[...] = want  # as if every byte arrived
    return engine, prefill_groups, request


def test_a_wrong_byte_in_a_named_block_is_allowed_and_in_an_unnamed_one_is_caught():
    engine, prefill_groups, request = _failed_read()
    named = [list(request.local_block_ids[0]), []]  # group 0 failed; group 1 reported complete
    assert check_failed_read(engine, prefill_groups, request, named) == []
    spec0, spec1 = engine.cache.groups[0].spec, engine.cache.groups[1].spec
    inside = np.flatnonzero(blocks_mask(spec0, 1, 0, named[0]))[5]
    engine.buffers[0][0][inside] ^= 0xFF  # damage inside a named block: the engine will not use it
    assert check_failed_read(engine, prefill_groups, request, named) == []
    wrong = np.flatnonzero(blocks_mask(spec1, 1, 0, request.local_block_ids[1]))[3]
    engine.buffers[1][1][wrong] ^= 0xFF  # damage in group 1, which the completion called complete
    (problem,) = check_failed_read(engine, prefill_groups, request, named)
    assert "group 1 region 1" in problem and "1 wrong bytes" in problem


def test_a_stray_write_outside_every_region_is_caught():
    engine, prefill_groups, request = _failed_read("gqa")
    engine.arena[0] ^= 0xFF  # the gap before the first region
    assert any("outside every region" in p for p in check_failed_read(engine, prefill_groups, request, [[]]))
