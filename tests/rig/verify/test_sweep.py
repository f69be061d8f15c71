"""Byte-exact proof of the plan for every layout and TP pairing.

Prefill caches are tagged with their global coordinates; the planned spans
are copied with numpy; every decode byte is compared with the oracle, and the
notification sets are compared with a brute-force reference.
"""

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.layout.builders import ORDERS, order_strides
from kvxferd.layout.specs import ATTENTION_LAYOUTS, SELF_PAIRED_LAYOUTS, AttentionSpec, MambaSpec
from kvxferd.rig.verify.scenario import run_scenario

from tests.sampling import covering
from tests.tp.test_shards import brute_owned

HEADS = [1, 2, 3, 4, 5, 7, 8, 16, 32]
TP_SIZES = range(1, 9)
RNG = np.random.default_rng(7)


def request(num_blocks, n):
    """Distinct decode blocks paired with arbitrary prefill blocks."""
    n = min(n, num_blocks)
    return RNG.permutation(num_blocks)[:n], RNG.integers(0, num_blocks, n)


def check(prefill_spec, decode_spec, p, d, n=4):
    decode_ids, prefill_ids = request(decode_spec.num_blocks, n)
    result = run_scenario(prefill_spec, decode_spec, p, d, decode_ids, prefill_ids)
    assert result.ok, f"P={p} D={d} {prefill_spec} -> {decode_spec}: {result.mismatches[0]}"
    check_notifications(decode_spec.sharded_extents, result.reads, p, d)
    return result


def check_notifications(extents, reads, p, d):
    """Each decode rank notifies exactly the prefill ranks holding data it needs."""
    notified = Counter()
    for r, plan in enumerate(reads):
        touching = {q for q in range(p) for g in extents if brute_owned(g, p, q) & brute_owned(g, d, r)}
        assert set(plan.notify_ranks) == touching
        assert set(plan.read_ranks) <= touching
        notified.update(touching)
    for q in range(p):
        assert reads[0].pairing.num_notifiers(q) == notified[q] >= 1


def strided(spec: AttentionSpec, tp: int, order: str, content: str) -> AttentionSpec:
    """``spec`` stored in vLLM's physical ``order`` as ``tp`` ranks allocate it (strides for the largest rank)."""
    heads = 1 if content == "latent" else -(-spec.num_kv_heads // tp)
    kernel = spec.kernel_block_size or spec.block_size
    strides = order_strides(order, content, num_layers=spec.num_layers, num_heads=heads, block_size=kernel,
                            num_blocks=spec.num_blocks * spec.block_size // kernel, head_size=spec.head_size)
    return spec.with_(layout="strided", strides=strides, num_kv_heads=1 if content == "latent" else spec.num_kv_heads)


# k_transposed needs each head's tokens packed: orders whose inner dims are H, N, C.
STRIDED_CASES = [(o, c) for c in ("kv", "latent", "bytes") for o in ORDERS] + [
    (o, "k_transposed") for o in ORDERS if o.endswith("HNC")]


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
def test_attention_every_tp_pair_and_head_count(layout):
    for i, (heads, p, d) in enumerate(itertools.product(HEADS, TP_SIZES, TP_SIZES)):
        spec = AttentionSpec(layout, num_blocks=6, num_kv_heads=heads, head_size=2, block_size=4, num_layers=2)
        if layout != "strided":
            check(spec, spec, p, d)
            continue
        # every order against every other, in turn, with each content
        prefill_order, content = STRIDED_CASES[i % len(STRIDED_CASES)]
        decode_orders = [o for o, c in STRIDED_CASES if c == content]
        decode_order = decode_orders[(i // len(STRIDED_CASES)) % len(decode_orders)]
        check(strided(spec, p, prefill_order, content), strided(spec, d, decode_order, content), p, d)


def test_strided_orders_all_pairs_with_kernel_blocks():
    """Every vLLM order into every other, across TP and a decode of kernel blocks half the size."""
    for (po, content), (do, dc), (p, d) in itertools.product(STRIDED_CASES, STRIDED_CASES, [(1, 1), (2, 1), (1, 4)]):
        if content != dc:
            continue
        spec = AttentionSpec("strided", num_blocks=5, num_kv_heads=4, head_size=3, block_size=8, num_layers=3)
        check(strided(spec, p, po, content), strided(spec.with_(kernel_block_size=4), d, do, content), p, d)


# Every head count and TP pair in each case; group counts and conv orders in turn by default (all with -m slow).
@pytest.mark.parametrize("groups, conv_order, conv_parts", covering([1, 3, 8], ["WD", "DW"], ["xBC", "BCx"]))
def test_mamba_every_tp_pair(groups, conv_order, conv_parts):
    for heads, p, d in itertools.product(HEADS, TP_SIZES, TP_SIZES):
        spec = MambaSpec(num_blocks=5, num_heads=heads, head_dim=2, num_groups=groups, state_size=3,
                         conv_window=3, conv_order=conv_order, conv_parts=conv_parts)
        check(spec, spec, p, d)


def mamba_layers(spec: MambaSpec, tp: int, order: str, num_layers: int = 3) -> MambaSpec:
    """``spec``'s pages for ``num_layers`` layers in one region as vLLM 0.32 lays them out: ``"BL"`` a block's
    layers side by side (block-outer, what hybrid models get), ``"LB"`` each layer's pages together."""
    page = max(spec.region(tp, r).num_bytes // spec.num_blocks for r in range(tp))  # the widest rank's page
    page = -(-page // 8) * 8  # whole elements of both states' dtypes
    block, layer = (num_layers * page, page) if order == "BL" else (page, spec.num_blocks * page)
    return spec.with_(page_bytes=page, block_stride=block, num_layers=num_layers, layer_stride=layer)


@pytest.mark.parametrize("prefill_order, decode_order", [("BL", "BL"), ("BL", "LB"), ("LB", "BL")])
def test_mamba_pages_of_every_layer_in_one_region(prefill_order, decode_order):
    """vLLM 0.32's Mamba pages (one region per group, pages a block row apart) across TP pairs and orders."""
    for heads, groups, p, d in itertools.product([1, 4, 6], [1, 3], [1, 2, 3], [1, 2, 4]):
        spec = MambaSpec(num_blocks=4, num_heads=heads, head_dim=2, num_groups=groups, state_size=3, conv_window=3)
        check(mamba_layers(spec, p, prefill_order), mamba_layers(spec, d, decode_order), p, d)


PAIRS = [
    ("packed_HND", "packed_NHD", None, None),
    ("packed_NHD", "packed_HND", None, None),
    ("packed_HND", "legacy", None, None),
    ("legacy", "packed_NHD", None, None),
    ("split_kv", "packed_HND", None, None),
    ("packed_HND", "packed_HND", 2, None),  # prefill stores 2 kernel blocks per block
    ("packed_HND", "packed_HND", None, 4),  # decode stores 4 kernel blocks per block
    ("packed_NHD", "legacy", 4, 2),
    ("mla", "mla", 2, 4),
    ("kv_per_head_kt", "kv_per_head_kt", 2, None),
    ("kv_per_head_kt", "kv_per_head_kt", None, 4),
]


@pytest.mark.parametrize("prefill_layout, decode_layout, prefill_k, decode_k", PAIRS)
def test_layout_pairs_every_tp_pair(prefill_layout, decode_layout, prefill_k, decode_k):
    for heads, p, d in itertools.product([1, 3, 4, 8], TP_SIZES, TP_SIZES):
        base = AttentionSpec(prefill_layout, num_blocks=5, num_kv_heads=heads, head_size=2, block_size=8)
        prefill = base.with_(kernel_block_size=8 // prefill_k if prefill_k else None)
        decode = base.with_(layout=decode_layout, kernel_block_size=8 // decode_k if decode_k else None)
        check(prefill, decode, p, d)


def test_coarsest_granularity_is_used():
    spec = AttentionSpec("packed_HND", num_blocks=8, num_kv_heads=8, head_size=4, block_size=4)
    ids = np.arange(8)
    # Same TP, same layout: the whole request is one span per rank pair.
    same = run_scenario(spec, spec, 2, 2, ids, ids)
    assert same.num_spans == 2 and same.num_spans_unmerged == 2 * 8
    # HND <-> NHD: one span per (head, token) of each block.
    mixed = run_scenario(spec, spec.with_(layout="packed_NHD"), 1, 1, ids[:3], ids[:3])
    assert mixed.ok and mixed.num_spans_unmerged == 3 * 8 * 4
    # Consecutive blocks: the last row of block b touches the first of b+1 on both sides.
    assert mixed.num_spans == 3 * 8 * 4 - 2


@st.composite
def scenarios(draw):
    p, d = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    if draw(st.booleans()):
        spec = MambaSpec(num_blocks=draw(st.integers(1, 6)), num_heads=draw(st.integers(1, 40)),
                         head_dim=draw(st.integers(1, 3)), num_groups=draw(st.integers(1, 9)),
                         state_size=draw(st.integers(1, 3)), conv_window=draw(st.integers(1, 4)),
                         conv_dtype=draw(st.sampled_from(["bfloat16", "float32", "uint8"])),
                         ssm_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                         conv_order=draw(st.sampled_from(["WD", "DW"])),
                         conv_parts=draw(st.sampled_from(["xBC", "BCx"])))
        return spec, spec, p, d
    block = draw(st.sampled_from([1, 2, 4, 8]))
    kernels = [k for k in (1, 2, 4, 8) if block % k == 0]
    spec = AttentionSpec(draw(st.sampled_from(ATTENTION_LAYOUTS)), num_blocks=draw(st.integers(1, 6)),
                         num_kv_heads=draw(st.integers(1, 40)), head_size=draw(st.integers(1, 4)), block_size=block,
                         kernel_block_size=draw(st.sampled_from(kernels)),
                         dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"])),
                         num_layers=draw(st.integers(1, 3)))
    compatible = [spec.layout] if spec.layout in SELF_PAIRED_LAYOUTS else [
        name for name in ATTENTION_LAYOUTS if name not in SELF_PAIRED_LAYOUTS]
    decode = spec.with_(layout=draw(st.sampled_from(compatible)), kernel_block_size=draw(st.sampled_from(kernels)))
    if spec.layout == "strided":
        content = draw(st.sampled_from(["kv", "latent", "bytes", "k_transposed"]))
        orders = [o for o, c in STRIDED_CASES if c == content]
        spec, decode = strided(spec, p, draw(st.sampled_from(orders)), content), strided(
            decode, d, draw(st.sampled_from(orders)), content)
    return spec, decode, p, d


@given(scenarios(), st.data())
def test_random_scenarios(scenario, data):
    prefill, decode, p, d = scenario
    n = data.draw(st.integers(0, decode.num_blocks))
    check(prefill, decode, p, d, n)
