"""``strided`` caches (vLLM >= 0.32): every physical order addresses every element where numpy's view does."""

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.builders import ORDERS, CacheStrides, order_strides, strided_attention
from kvxferd.layout.specs import AttentionSpec
from kvxferd.rig.verify.physical import region_num_bytes
from tests.layout.brute import addresses

LAYERS, BLOCKS, HEADS, TOKENS, HEAD_SIZE = 3, 5, 4, 8, 6


def numpy_offsets(strides: CacheStrides, content: str, heads: int, kernel: int, blocks: int) -> np.ndarray:
    """Element offset of every (L, B, H, N, content) as numpy's own strided view puts it (the engine's truth)."""
    width = HEAD_SIZE if content == "latent" else 2 * HEAD_SIZE
    shape = (LAYERS, blocks, 1 if content == "latent" else heads, kernel, width)
    index = np.arange(10**6, dtype=np.int64)
    view = np.lib.stride_tricks.as_strided(index, shape, tuple(8 * s for s in (strides.layer, strides.block,
                                                                               strides.head, strides.token, 1)))
    return view


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 1), (4, 3)])
def test_kv_content_is_addressed_where_the_engine_puts_it(order, tp, rank):
    heads = HEADS // tp
    strides = order_strides(order, "kv", num_layers=LAYERS, num_blocks=BLOCKS, num_heads=heads, block_size=TOKENS,
                            head_size=HEAD_SIZE)
    region = strided_attention(BLOCKS, LAYERS, HEADS, TOKENS, HEAD_SIZE, "bfloat16", strides, tp_size=tp, tp_rank=rank)
    field = region.field("kv")
    assert field.shard.local_range == (rank * heads, (rank + 1) * heads)
    ours = addresses(field.layout, ("L", "B", "H", "N", "KV", "C"))
    engine = numpy_offsets(strides, "kv", heads, TOKENS, BLOCKS).reshape(LAYERS, BLOCKS, heads, TOKENS, 2, HEAD_SIZE)
    np.testing.assert_array_equal(ours, engine)
    spec = AttentionSpec("strided", BLOCKS, HEADS, HEAD_SIZE, TOKENS, num_layers=LAYERS, strides=strides)
    assert region.num_bytes == region_num_bytes(spec, tp, rank) == LAYERS * BLOCKS * heads * TOKENS * 2 * HEAD_SIZE * 2


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC"])  # vLLM splits blocks into kernel blocks only there
def test_kernel_blocks_group_into_logical_blocks(order):
    kernel, k = 4, 2
    strides = order_strides(order, "kv", num_layers=LAYERS, num_blocks=BLOCKS * k, num_heads=HEADS, block_size=kernel,
                            head_size=HEAD_SIZE)
    region = strided_attention(BLOCKS, LAYERS, HEADS, kernel * k, HEAD_SIZE, "bfloat16", strides, kernel_block_size=kernel)
    ours = addresses(region.field("kv").layout, ("L", "B", "H", "N", "KV", "C"))
    engine = numpy_offsets(strides, "kv", HEADS, kernel, BLOCKS * k).reshape(LAYERS, BLOCKS, k, HEADS, kernel, 2, HEAD_SIZE)
    # logical token n of block b is kernel block b*k + n // kernel, token n % kernel
    np.testing.assert_array_equal(ours, engine.transpose(0, 1, 3, 2, 4, 5, 6).reshape(ours.shape))


@pytest.mark.parametrize("order", ORDERS)
def test_latent_has_no_heads_and_is_replicated(order):
    strides = order_strides(order, "latent", num_layers=LAYERS, num_blocks=BLOCKS, num_heads=1, block_size=TOKENS,
                            head_size=HEAD_SIZE)
    for rank in range(4):
        field = strided_attention(BLOCKS, LAYERS, 1, TOKENS, HEAD_SIZE, "bfloat16", strides, tp_size=4,
                                  tp_rank=rank).field("latent")
        assert field.shard is None
        engine = numpy_offsets(strides, "latent", 1, TOKENS, BLOCKS)[:, :, 0]
        np.testing.assert_array_equal(addresses(field.layout, ("L", "B", "N", "C")), engine)


def test_k_transposed_splits_each_head_into_k_then_v():
    strides = order_strides("LBHNC", "k_transposed", num_layers=LAYERS, num_blocks=BLOCKS, num_heads=HEADS,
                            block_size=TOKENS, head_size=HEAD_SIZE)
    region = strided_attention(BLOCKS, LAYERS, HEADS, TOKENS, HEAD_SIZE, "float32", strides)
    per_head = numpy_offsets(strides, "kv", HEADS, TOKENS, BLOCKS).reshape(LAYERS, BLOCKS, HEADS, 2, -1)
    key = per_head[:, :, :, 0].reshape(LAYERS, BLOCKS, HEADS, HEAD_SIZE, TOKENS)
    value = per_head[:, :, :, 1].reshape(LAYERS, BLOCKS, HEADS, TOKENS, HEAD_SIZE)
    np.testing.assert_array_equal(addresses(region.field("k").layout, ("L", "B", "H", "C", "N")), key)
    np.testing.assert_array_equal(addresses(region.field("v").layout, ("L", "B", "H", "N", "C")), value)


def test_a_wrong_order_is_seen():
    """Negative control: the test above compares for real (another order's strides address other elements)."""
    kw = dict(num_layers=LAYERS, num_blocks=BLOCKS, num_heads=HEADS, block_size=TOKENS, head_size=HEAD_SIZE)
    region = strided_attention(BLOCKS, LAYERS, HEADS, TOKENS, HEAD_SIZE, "bfloat16", order_strides("LBNHC", "kv", **kw))
    engine = numpy_offsets(order_strides("LBHNC", "kv", **kw), "kv", HEADS, TOKENS, BLOCKS)
    assert not np.array_equal(addresses(region.field("kv").layout, ("L", "B", "H", "N", "KV", "C")),
                              engine.reshape(LAYERS, BLOCKS, HEADS, TOKENS, 2, HEAD_SIZE))


@pytest.mark.parametrize("strides, field", [
    (CacheStrides("kv", 0, 96, 24, 12), "strides[L]"),  # layers on top of each other
    (CacheStrides("kv", 10**4, 96, 24, 6), "strides[KV]"),  # a token's K|V overlaps the next token
    (CacheStrides("k_transposed", 10**4, 96 * 4, 96, 24), "strides.token"),  # a head's tokens not packed
    (CacheStrides("k_transposed", 10**4, 96 * 4, 48, 12), "strides[H]"),  # one head's K on the last one's V
    (CacheStrides("kv", 1 << 49, 384, 96, 12), "strides"),  # past any cache: block tables would near int64's end
])
def test_overlapping_or_impossible_strides_are_refused(strides, field):
    with pytest.raises(InvalidArgumentError) as err:
        strided_attention(BLOCKS, LAYERS, HEADS, TOKENS, HEAD_SIZE, "bfloat16", strides)
    assert err.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(content="mixed"), "strides.content"),
    (dict(layer=-1), "strides.layer"),
    (dict(token=True), "strides.token"),
])
def test_bad_strides_name_the_field(kwargs, field):
    values = {**dict(content="kv", layer=1, block=1, head=1, token=1), **kwargs}
    with pytest.raises(InvalidArgumentError) as err:
        CacheStrides(**values)
    assert err.value.field == field
    with pytest.raises(InvalidArgumentError, match="strides"):
        AttentionSpec("strided", BLOCKS, HEADS, HEAD_SIZE, TOKENS).region()
