"""Logical digests (issue #59): the layout algebra's vectorised sums against a brute force over the
oracle's own views (rig/verify/physical.py, which never uses the algebra), for every cache kind."""

from dataclasses import replace

import numpy as np
import pytest

from kvxferd.layout.digests import (
    WORD_DIM, atom_tokens, chunk_bounds, dim_weights, elements_per_word, field_chunks, field_digests, field_key)
from kvxferd.layout.specs import AttentionSpec, MambaSpec
from kvxferd.rig.verify.physical import region_num_bytes, region_views
from kvxferd.tp.shards import owned_range

ATTENTION = ["packed_HND", "packed_NHD", "kv_per_head", "split_kv", "legacy", "kv_per_head_kt", "mla", "cross_layer"]
MAMBA = MambaSpec(num_blocks=6, num_heads=4, head_dim=4, num_groups=2, state_size=4, conv_window=3)


def brute_digests(spec, tp_size, tp_rank, memory, block_ids, group, region, tokens_per_atom):
    """{(row, atom, global chunk): digest} from the oracle's coordinates of every element (numpy wraps
    uint64 arrays mod 2**64, as the definition does)."""
    out: dict = {}
    for view in region_views(spec, tp_size, tp_rank, memory):
        key = field_key(group, region, view.field)
        shape = view.array.shape
        coords = {d: np.broadcast_to(c, shape).ravel() for d, c in view.coords.items()}
        rows = np.searchsorted(block_ids, np.broadcast_to(view.block, shape).ravel())
        held = np.isin(np.broadcast_to(view.block, shape).ravel(), block_ids)
        values = view.array.ravel().astype(np.uint64)
        itemsize = view.array.dtype.itemsize
        field = next(f for f in spec.region(tp_size, tp_rank).fields if f.name == view.field)
        per_word = elements_per_word(field.layout)
        weight = np.ones(values.size, np.uint64)
        atom = chunk = np.zeros(values.size, np.int64)
        for dim, index in coords.items():
            if dim == "N":
                atom, index = np.divmod(index, tokens_per_atom)
            if dim == WORD_DIM and per_word > 1:  # A(w) << place, plus B(w) << (place - half) in the top half
                word, place = index // per_word, (index % per_word).astype(np.uint64)
                half = np.uint64(per_word // 2)
                w = dim_weights(key, dim, int(word.max()) + 1)[word] << (np.uint64(8 * itemsize) * place)
                top = place >= half
                b = dim_weights(key, dim + ">>32", int(word.max()) + 1)[word]
                w = w + np.where(top, b << (np.uint64(8 * itemsize) * (place - np.where(top, half, place))), 0).astype(np.uint64)
            else:
                w = dim_weights(key, dim, int(index.max()) + 1)[index]
            weight = weight * w
            if field.shard is not None and dim == field.shard.dim:
                chunk = np.searchsorted(chunk_bounds(field.shard.global_extent), index, "right") - 1
        terms = (weight * values)[held]
        for slot, term in zip(zip(rows[held].tolist(), atom[held].tolist(), chunk[held].tolist()), terms.tolist()):
            out[slot] = (out.get(slot, 0) + term) & (2**64 - 1)
    return out


def algebra_digests(spec, tp_size, tp_rank, memory, block_ids, group, region, tokens_per_atom):
    out: dict = {}
    for f in spec.region(tp_size, tp_rank).fields:
        digests = field_digests(memory, f, np.asarray(block_ids), field_key(group, region, f.name), tokens_per_atom)
        chunk_ids, _ = field_chunks(f)
        for (row, atom, c), value in np.ndenumerate(digests):
            slot = (row, atom, int(chunk_ids[c]))
            out[slot] = (out.get(slot, 0) + int(value)) & (2**64 - 1)
    return out


CASES = [(layout, kernel, dtype, tp) for layout in ATTENTION for kernel in (None, 8)
         for dtype in ("bfloat16", "float8_e4m3fn", "float32") for tp in ((1, 0), (2, 1), (3, 2))
         if not (layout == "mla" and tp != (1, 0))]


@pytest.mark.parametrize("layout, kernel, dtype, tp", CASES, ids=lambda *a: None)
def test_digests_of_the_algebra_equal_the_brute_force_over_the_oracles_views(layout, kernel, dtype, tp):
    spec = AttentionSpec(layout, num_blocks=4, num_kv_heads=3, head_size=8, block_size=32, kernel_block_size=kernel,
                         dtype=dtype, num_layers=2 if layout == "cross_layer" else 1)
    if layout == "mla":
        spec = replace(spec, num_kv_heads=1)
    memory = np.random.default_rng(len(CASES)).integers(0, 256, region_num_bytes(spec, *tp), dtype=np.uint8)
    block_ids = [0, 3]
    tokens = atom_tokens(spec.block_size)
    expected = brute_digests(spec, *tp, memory, block_ids, 1, 2, tokens)
    assert algebra_digests(spec, *tp, memory, block_ids, 1, 2, tokens) == expected
    flip_one_held_element(spec, tp, memory, block_ids[-1])  # negative control: exactly one digest changes
    changed = algebra_digests(spec, *tp, memory, block_ids, 1, 2, tokens)
    assert sum(changed[k] != expected[k] for k in expected) == 1


def flip_one_held_element(spec, tp, memory, block_id):
    """Flip the top bit of one element of ``block_id`` (through the oracle's view of it)."""
    view = region_views(spec, *tp, memory)[-1]
    index = np.argwhere(np.broadcast_to(view.block, view.array.shape) == block_id)[-1]
    view.array[tuple(index)] ^= view.array.dtype.type(1 << (8 * view.array.dtype.itemsize - 1))


@pytest.mark.parametrize("tp", [(1, 0), (2, 0), (2, 1)])
def test_mamba_state_pages_digest_like_the_brute_force(tp):
    memory = np.random.default_rng(5).integers(0, 256, region_num_bytes(MAMBA, *tp), dtype=np.uint8)
    expected = brute_digests(MAMBA, *tp, memory, [1, 4], 0, 0, 1)
    assert algebra_digests(MAMBA, *tp, memory, [1, 4], 0, 0, 1) == expected and len(expected) > 2
    flip_one_held_element(MAMBA, tp, memory, 4)
    changed = algebra_digests(MAMBA, *tp, memory, [1, 4], 0, 0, 1)
    assert sum(changed[k] != expected[k] for k in expected) == 1


def test_every_layout_of_one_logical_cache_gives_the_same_digests():
    """The same logical KV (the oracle's tags are functions of the coordinates only) in every layout and
    TP slicing: per global chunk the digests agree; another region key (the wrong layer) differs."""
    from kvxferd.rig.verify.oracle import tagged_region

    results = {}
    for layout in ["packed_HND", "packed_NHD", "kv_per_head", "split_kv", "legacy"]:
        for tp_size in (1, 2, 4):
            merged: dict = {}
            for tp_rank in range(tp_size):
                spec = AttentionSpec(layout, num_blocks=3, num_kv_heads=4, head_size=16, block_size=16)
                memory = tagged_region(spec, tp_size, tp_rank, region_key=7)
                merged.update(algebra_digests(spec, tp_size, tp_rank, memory, [2, 1], 0, 0, 16))
            results[(layout, tp_size)] = merged
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()) and len(first) == 2 * 4  # 2 blocks x 4 head chunks
    spec = AttentionSpec("packed_HND", num_blocks=3, num_kv_heads=4, head_size=16, block_size=16)
    assert algebra_digests(spec, 1, 0, tagged_region(spec, 1, 0, region_key=8), [2, 1], 0, 0, 16) != first


def test_chunks_never_straddle_a_tp_slice():
    for extent in (1, 2, 3, 8, 12, 40, 96):
        bounds = set(chunk_bounds(extent).tolist())
        for tp_size in range(1, 17):
            for tp_rank in range(tp_size):
                start, stop = owned_range(extent, tp_size, tp_rank)
                assert start in bounds and stop in bounds


def test_a_block_that_is_not_whole_atoms_is_refused():
    from kvxferd.errors import LayoutMismatchError

    spec = AttentionSpec("packed_HND", num_blocks=2, num_kv_heads=1, head_size=8, block_size=24)
    memory = np.zeros(region_num_bytes(spec, 1, 0), np.uint8)
    assert atom_tokens(24) == 8
    with pytest.raises(LayoutMismatchError):
        field_digests(memory, spec.region().fields[0], np.array([0]), 1, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_two_sign_flips_in_the_top_element_of_words_do_not_cancel(dtype):
    """Found by the review of issue #59: with one weight per word the top element kept 16 (8) bits of
    weight and two sign flips there always cancelled; every element now keeps at least 40."""
    spec = AttentionSpec("packed_HND", num_blocks=2, num_kv_heads=1, head_size=16, block_size=16, dtype=dtype)
    memory = np.random.default_rng(9).integers(0, 256, region_num_bytes(spec, 1, 0), dtype=np.uint8)
    field = spec.region().fields[0]
    before = field_digests(memory, field, np.array([1]), 3, 16)
    word = int(field.layout.block_table_bytes[1]) + 8 * 5  # block 1, some word of its first token
    memory[word + 7] ^= 0x80  # the sign bit of the word's top element
    memory[word + 8 + 7] ^= 0x80  # and of the next word's
    assert not np.array_equal(field_digests(memory, field, np.array([1]), 3, 16), before)


def test_no_blocks_digest_to_nothing_and_wide_tp_is_whole_chunks():
    spec = AttentionSpec("packed_NHD", num_blocks=2, num_kv_heads=64, head_size=8, block_size=16)
    for tp_rank in (0, 1, 15, 31):
        field = spec.region(32, tp_rank).fields[0]
        memory = np.zeros(region_num_bytes(spec, 32, tp_rank), np.uint8)
        assert field_digests(memory, field, np.array([1]), 3, 16).shape == (1, 1, len(field_chunks(field)[0]))
        assert field_digests(memory, field, np.zeros(0, np.int64), 3, 16).shape[0] == 0
