"""Standard layout builders: sizes agree with the engine's allocation; bad input is typed."""

import pytest

from kvxferd.errors import InvalidArgumentError, TpConfigError
from kvxferd.layout import builders
from kvxferd.layout.specs import ATTENTION_LAYOUTS, AttentionSpec, MambaSpec
from kvxferd.rig.verify.physical import region_num_bytes


@pytest.mark.parametrize("layout", [name for name in ATTENTION_LAYOUTS if name != "strided"])
@pytest.mark.parametrize("heads, tp", [(8, 1), (8, 3), (2, 4), (5, 2)])
def test_attention_region_sizes(layout, heads, tp):
    spec = AttentionSpec(layout, num_blocks=7, num_kv_heads=heads, head_size=16, block_size=8,
                         kernel_block_size=4, num_layers=3)
    for rank in range(tp):
        region = spec.region(tp, rank)
        assert region.num_bytes == region_num_bytes(spec, tp, rank)
        assert region.num_blocks == 7
        layout_ = region.fields[0].layout
        assert layout_.size("N") == 8 and layout_.end_bytes <= region.num_bytes


def test_packed_dims_are_logical_whatever_the_memory_order():
    for order in ("HND", "NHD"):
        region = builders.packed_attention(4, 8, 16, 64, tp_size=2, tp_rank=1, order=order)
        field = region.fields[0]
        assert set(field.layout.dims) == {"B", "H", "N", "KV", "C"}
        assert field.layout.shape["H"] == 4 and field.shard.local_range == (4, 8)


def test_replicated_heads_hold_one_head():
    region = builders.packed_attention(4, 2, 16, 64, tp_size=8, tp_rank=5)
    assert region.fields[0].shard.local_range == (1, 2) and region.fields[0].layout.shape["H"] == 1


def test_mamba_page_fields():
    spec = MambaSpec(num_blocks=3, num_heads=8, head_dim=4, num_groups=1, state_size=16, conv_window=4)
    region = spec.region(2, 1)
    assert [f.name for f in region.fields] == ["conv_x", "conv_b", "conv_c", "ssm"]
    assert region.field("conv_b").shard.local_range == (0, 1)  # one group, replicated
    assert region.field("ssm").shard.local_range == (4, 8)
    assert region.num_bytes == region_num_bytes(spec, 2, 1)


def test_gdn_conv_channels_are_q_k_v():
    """GDN's conv state holds [q | k | v]: B and C (key heads) first, then x (value heads); TP rank 1 of 2."""
    spec = MambaSpec(num_blocks=3, num_heads=8, head_dim=4, num_groups=2, state_size=16, conv_window=4,
                     conv_dtype="float32", conv_parts="BCx")
    region = spec.region(2, 1)
    # a rank holds 4 value heads x 4 = 16 x channels and 1 key head x 16 = 16 channels each of B and C
    offsets = {f.name: f.layout.offset for f in region.fields if f.name.startswith("conv")}
    assert offsets == {"conv_b": 0, "conv_c": 16, "conv_x": 32}
    assert region.num_bytes == region_num_bytes(spec, 2, 1) == spec.with_(conv_parts="xBC").region(2, 1).num_bytes


@pytest.mark.parametrize(
    "call, error, field",
    [
        (lambda: builders.packed_attention(0, 8, 16, 64), InvalidArgumentError, "num_blocks"),
        (lambda: builders.packed_attention(4, 0, 16, 64), InvalidArgumentError, "num_kv_heads"),
        (lambda: builders.packed_attention(4, 8, 16, 64, kernel_block_size=5), InvalidArgumentError, "kernel_block_size"),
        (lambda: builders.packed_attention(4, 8, 16, 64, order="HDN"), InvalidArgumentError, "order"),
        (lambda: builders.packed_attention(4, 8, 16, 64, tp_size=2, tp_rank=2), TpConfigError, "tp_rank"),
        (lambda: builders.packed_attention(4, 8, 16, 64, dtype="fp7"), InvalidArgumentError, "dtype"),
        (lambda: builders.mla_attention(4, 16, 0), InvalidArgumentError, "latent_size"),
        (lambda: builders.mamba_page(2, num_heads=4, head_dim=2, num_groups=1, state_size=4, conv_window=4,
                                     page_bytes=8), InvalidArgumentError, "page_bytes"),
        (lambda: builders.mamba_page(2, num_heads=4, head_dim=2, num_groups=1, state_size=4, conv_window=4,
                                     conv_order="XY"), InvalidArgumentError, "conv_order"),
        (lambda: builders.mamba_page(2, num_heads=4, head_dim=2, num_groups=1, state_size=4, conv_window=4,
                                     conv_parts="qkv"), InvalidArgumentError, "conv_parts"),
        (lambda: AttentionSpec("paged", 4, 8, 64, 16).region(), InvalidArgumentError, "layout"),
    ],
)
def test_bad_input_names_the_field(call, error, field):
    with pytest.raises(error) as err:
        call()
    assert err.value.field == field


def test_mamba_pages_a_block_row_apart_and_their_refusals():
    """vLLM 0.32 puts a Mamba layer's pages a whole block row apart; pages that meet, or strides that split
    an element, are refused."""
    base = MambaSpec(num_blocks=3, num_heads=4, head_dim=2, num_groups=1, state_size=4, conv_window=3)
    page = base.region().num_bytes // 3
    spec = base.with_(block_stride=2 * page, num_layers=2, layer_stride=page)  # [blk 0: L0 L1 | blk 1: L0 L1 | ..]
    region = spec.region()
    assert region.num_bytes == region_num_bytes(spec, 1, 0) == 3 * 2 * page
    assert [f.layout.dims[:2] for f in region.fields] == [("L", "B")] * 4
    for change, field in ((dict(block_stride=page // 2), "strides[L]"), (dict(block_stride=page + 2), "block_stride"),
                          (dict(layer_stride=None), "layer_stride")):
        with pytest.raises(InvalidArgumentError) as err:
            spec.with_(**change).region()
        assert err.value.field == field, err.value
