"""Every layout vLLM's backends can resolve, described from the layer views and addressed byte for byte.

vLLM 0.32 lays the whole cache out in one allocation, in one of six physical
orders picked from the backends' supported sets (vllm/v1/kv_cache_layout.py).
For every backend that imports here and every layout it supports, with
several shapes (heads, head sizes, block sizes, dtypes incl. fp8), vLLM's own
allocator builds the cache on CPU, every byte is tagged through vLLM's views,
and the connector's description must address every (layer, block, head,
token, K/V, channel) where vLLM put it.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (scripts/bootstrap.sh --vllm)")

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxferd.integrations.vllm.connector import CONTENT_READERS  # noqa: E402
from kvxferd.integrations.vllm.describe import strided_group  # noqa: E402
from tests.integrations.layer_tags import (one_group_read, pd_read, read_our_way, strided_layer_views,  # noqa: E402
                                           tag_through_views, wrong_decode_blocks)
from tests.integrations.vllm_alloc import allocate  # noqa: E402


# Importing this one aborts the process (a native library's dlopen fails hard on a CPU build).
ABORTS_ON_IMPORT = {"ROCM_FLASHMLA_SPARSE_DSV4"}


def importable_backends() -> dict[str, type]:
    """Backend classes of vLLM's registry that import on this machine, by enum name."""
    found = {}
    for member in AttentionBackendEnum:
        if member.name in ABORTS_ON_IMPORT:
            continue
        try:
            found[member.name] = member.get_class()
        except Exception:  # noqa: BLE001 - a GPU-only backend's import fails in many ways on CPU
            continue
    return found


BACKENDS = importable_backends()
# Backends kvxferd refuses, and the feature each one's refusal must name.
REFUSED = {"ROCM_ATTN": "head slots", "ROCM_SEGMENTED_ATTN": "head slots", "B12X": "head slots"}
ATTENTION_SHAPES = [  # (local heads, head size, block size, dtype)
    (2, 64, 16, torch.bfloat16), (1, 128, 32, torch.float16), (4, 80, 16, torch.float8_e4m3fn), (3, 32, 64, torch.float32)]
MLA_SHAPES = [(1, 576, 16, torch.bfloat16), (1, 576, 64, torch.float8_e4m3fn)]


def backend_layouts(backend) -> tuple[KVCacheLayout, ...]:
    return backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)  # None: the kernels take any layout


def cases():
    for name, backend in sorted(BACKENDS.items()):
        mla = backend.is_mla()
        for layout in backend_layouts(backend):
            for shape in (MLA_SHAPES if mla else ATTENTION_SHAPES):
                yield pytest.param(name, layout, shape, id=f"{name}-{layout.name}-{shape[1]}x{shape[2]}-{shape[3]}")


def spec_of(backend, shape):
    """The group's spec as vLLM hands it to the connector: after the backend's ``customize_spec``."""
    heads, head_size, block_size, dtype = shape
    if backend.is_mla():
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    customize = getattr(backend, "customize_spec", None)
    return customize(spec) if customize is not None else spec


def described(backend, spec, layers, total_heads, tp_size=1, tp_rank=0):
    """The connector's description of one group, as its worker on TP rank ``tp_rank`` makes it."""
    reader = CONTENT_READERS.get(f"{backend.__module__}.{backend.__qualname__}")
    fp8 = spec.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8_e4m3" if fp8 else "auto"),
                             model_config=SimpleNamespace(dtype=torch.bfloat16 if fp8 else spec.dtype))
    kind = "mla" if backend.is_mla() else "full"
    return strided_group(kind, [f"l{i}" for i in range(len(layers))], layers, spec, total_heads,
                         reader and functools.partial(reader, config, SimpleNamespace(), spec),
                         tp_size=tp_size, tp_rank=tp_rank)


def check_every_byte(group, layers, tp_size, tp_rank):
    for name, (ours, vllms) in read_our_way(group, layers, tp_size, tp_rank).items():
        wrong = np.flatnonzero(ours.reshape(-1) != vllms.reshape(-1))
        assert not len(wrong), f"field {name}: {len(wrong)} of {ours.size} bytes are not where vLLM put them"


def test_the_registry_has_the_backends_the_issue_names():
    """The sweep below is not empty: the CPU build imports these GPU backends' classes."""
    assert {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN"} <= BACKENDS.keys()
    assert any(b.is_mla() for b in BACKENDS.values())
    layouts = {layout for backend in BACKENDS.values() for layout in backend_layouts(backend)}
    assert layouts == set(KVCacheLayout)


@pytest.mark.parametrize("name, layout, shape", list(cases()))
def test_every_backend_layout_is_addressed_where_vllm_puts_it(name, layout, shape):
    backend = BACKENDS[name]
    spec = spec_of(backend, shape)
    tp_size, tp_rank = (2, 1) if not backend.is_mla() else (1, 0)  # rank 1 of 2: heads start at the local count
    try:
        layers, _ = allocate(spec, num_layers=3, num_blocks=5, layout=layout)
    except (AssertionError, ValueError) as err:  # e.g. LHBNC cannot pad the pages this backend asks for
        pytest.skip(f"vLLM itself does not allocate {name} in {layout.name}: {err}")
    tag_through_views(layers, spec.block_size, first_head=tp_rank * spec.num_kv_heads)
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            described(backend, spec, layers, spec.num_kv_heads * tp_size, tp_size, tp_rank)
        return
    try:
        group = described(backend, spec, layers, spec.num_kv_heads * tp_size, tp_size, tp_rank)
    except NotImplementedError as err:  # vLLM's own kernel choice refuses it (CPU: fp8 needs head sizes of 32 k)
        pytest.skip(f"vLLM itself does not run {name} with this cache: {err}")
    assert group.layout == "strided" and group.strides.content in ("kv", "k_transposed", "latent", "bytes")
    check_every_byte(group, layers, tp_size, tp_rank)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_kernel_blocks_inside_a_block_are_addressed_too(layout):
    """Block-compact, layer-outer layouts split a block into kernel blocks (vLLM refuses it for the others)."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers, _ = allocate(spec, num_layers=2, num_blocks=4, layout=layout, kernel_block_size=16)
    assert layers[0].shape[0] == 8 and layers[0].shape[2] == 16
    tag_through_views(layers, spec.block_size, first_head=0)
    group = described(BACKENDS["FLASH_ATTN"], spec, layers, 2)
    assert group.kernel_block_size == 16 and group.num_blocks == 4
    check_every_byte(group, layers, 1, 0)


def test_a_description_of_another_layout_is_caught():
    """Negative control: LBNHC memory described with LBHNC's strides fails the byte check."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers, _ = allocate(spec, num_layers=2, num_blocks=3, layout=KVCacheLayout.LBNHC)
    tag_through_views(layers, 16, first_head=0)
    group = described(BACKENDS["FLASH_ATTN"], spec, layers, 2)
    wrong = group.__class__(**{**vars(group), "strides": group.strides.__class__(
        "kv", group.strides.layer, group.strides.block, 16 * 128, 128)})
    with pytest.raises(AssertionError, match="not where vLLM put them"):
        check_every_byte(wrong, layers, 1, 0)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("content_bytes", [264, 136])
def test_content_with_scales_moves_whole_per_head_and_token(layout, content_bytes):
    """Triton's per-token-head quantisation keeps [K | scale | V | scale] per (head, token): moved as bytes."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.uint8,
                             state_content_bytes=content_bytes)
    layers, _ = allocate(spec, num_layers=2, num_blocks=4, layout=layout)
    tag_through_views(layers, 16, first_head=2)
    group = described(BACKENDS["TRITON_ATTN"], spec, layers, 4, 2, 1)
    assert (group.strides.content, group.dtype, group.head_size) == ("bytes", "uint8", content_bytes)
    check_every_byte(group, layers, 2, 1)


@pytest.mark.parametrize("change, missing", [
    (dict(num_head_slots=4), "head slots"),  # nvfp4's K heads then V heads; ROCm's K slot and V slot
    (dict(head_size_v=64), "V 64"),
])
def test_what_kvxferd_cannot_describe_is_refused_by_what_it_is(change, missing):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, **change)
    layers, _ = allocate(spec, num_layers=2, num_blocks=4, layout=KVCacheLayout.LBHNC)
    with pytest.raises(ValueError, match=missing):
        described(BACKENDS["FLASH_ATTN"], spec, layers, 2)


@pytest.mark.parametrize("misdescribed", [False, True], ids=["described", "negative-control"])
def test_prefill_lbnhc_tp2_to_decode_lbhnc_tp1_through_real_daemons(tmp_path, misdescribed):
    """Two layouts, two TP sizes, two block sizes, through real daemons, NIXL and the connector's pieces.

    Prefill: TP 2 (one KV head per rank), LBNHC, blocks of 32. Decode: TP 1, LBHNC, blocks of 16 in
    kernel blocks of 8. Every byte decode's views hold afterwards is the tag prefill's views wrote
    for the same (layer, head, token, content byte); every other block is untouched. The negative
    control describes decode's memory with LBNHC's head and token strides: the same check fails.
    """
    flash = BACKENDS["FLASH_ATTN"]
    prefill_spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    decode_spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    prefill_layers = [allocate(prefill_spec, 2, 8, KVCacheLayout.LBNHC)[0] for _ in range(2)]
    decode_layers, _ = allocate(decode_spec, 2, 12, KVCacheLayout.LBHNC, kernel_block_size=8)
    for rank, layers in enumerate(prefill_layers):
        tag_through_views(layers, 32, first_head=rank)
    decode_group = described(flash, decode_spec, decode_layers, 2)
    if misdescribed:
        strides = decode_group.strides
        decode_group = dataclasses.replace(decode_group, strides=dataclasses.replace(
            strides, head=strides.token, token=strides.token * 2))  # LBNHC's, for LBHNC memory
    prefill_groups = [described(flash, prefill_spec, layers, 2, 2, r) for r, layers in enumerate(prefill_layers)]
    one_group_read(tmp_path, prefill_groups, prefill_layers, decode_group, decode_layers, remote_ids=[5, 2],
                   decode_ids=[9, 1, 4, 7], num_tokens=60)
    wrong = wrong_decode_blocks(decode_layers, 16, [9, 1, 4, 7], [5, 2], 32)  # whole blocks move, past token 60 too
    assert bool(wrong) == misdescribed, wrong


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_the_gpu_tests_allocation_is_vllms(order):
    """tests/gpu lays caches out with ``strided_layer_views`` (no vLLM there): the same views as vLLM's allocator."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    ours = strided_layer_views(order, 3, 5, 2, 16, 64, torch.bfloat16)
    vllms, _ = allocate(spec, 3, 5, KVCacheLayout[order])
    for a, b in zip(ours, vllms):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


def test_the_connector_asks_for_lbhnc_unless_told_otherwise_and_refuses_pipeline_parallelism():
    from kvxferd.integrations.vllm.connector import KvxferdConnector

    def config(extra=None, use_mla=False, pp=1):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
                               model_config=SimpleNamespace(use_mla=use_mla),
                               parallel_config=SimpleNamespace(pipeline_parallel_size=pp))

    assert KvxferdConnector.get_required_kvcache_layout(config()) == "LBHNC"
    assert KvxferdConnector.get_required_kvcache_layout(config({"kv_cache_layout": "BLHNC"})) == "BLHNC"
    assert KvxferdConnector.get_required_kvcache_layout(config({"kv_cache_layout": "auto"})) is None
    assert KvxferdConnector.get_required_kvcache_layout(config(use_mla=True)) is None  # one head: any order
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        KvxferdConnector(config(pp=2), None, None)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC])
def test_full_and_sliding_window_groups_overlaying_one_allocation_read_through_daemons(tmp_path, layout):
    """A hybrid model's two groups alias the same bytes (vLLM hands a block id to one group at a time):
    two overlapping regions per engine, each read into its own blocks, nothing else written."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from tests.integrations.vllm_alloc import allocate_groups

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    ids = {"prefill": ([1, 2, 3], [4, 5, 6]), "decode": ([7, 2, 9], [3, 8, 1])}  # [full ids], [swa ids]
    (pf, ps), _ = allocate_groups([full, swa], 2, 12, layout)
    (df, ds), _ = allocate_groups([full, swa], 2, 12, layout)
    tag_through_views(pf, 16, 0, first_layer=0, block_ids=ids["prefill"][0])
    tag_through_views(ps, 16, 0, first_layer=2, block_ids=ids["prefill"][1])
    flash = BACKENDS["FLASH_ATTN"]

    def groups(full_layers, swa_layers):
        names = ["f0", "f1"], ["s0", "s1"]
        described_ = [strided_group(kind, n, layers, spec, 2) for kind, n, layers, spec in
                      (("full", names[0], full_layers, full), ("swa", names[1], swa_layers, swa))]
        return described_, dict(zip(names[0] + names[1], full_layers + swa_layers))

    (prefill_groups, prefill_tensors), (decode_groups, decode_tensors) = groups(pf, ps), groups(df, ds)
    assert prefill_groups[0].strides == prefill_groups[1].strides  # the same bytes, two groups
    pd_read(tmp_path, [prefill_groups], [prefill_tensors], decode_groups, decode_tensors,
            remote_ids=ids["prefill"], decode_ids=ids["decode"], num_tokens=48)
    assert wrong_decode_blocks(df, 16, ids["decode"][0], ids["prefill"][0], 16, other_ids=ids["decode"][1]) == []
    assert wrong_decode_blocks(ds, 16, ids["decode"][1], ids["prefill"][1], 16, first_layer=2,
                               other_ids=ids["decode"][0]) == []


def test_views_of_other_heads_than_the_rank_holds_are_refused():
    """A rank whose views hold 4 heads, described as holding 1 of 2 (total 2, TP 2): the daemon would
    move a quarter of the cache and nothing would fail; refused instead."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    layers, _ = allocate(spec, num_layers=2, num_blocks=3, layout=KVCacheLayout.LBHNC)
    with pytest.raises(ValueError, match="hold 4 heads"):
        described(BACKENDS["FLASH_ATTN"], spec, layers, 2, 2, 1)
    assert described(BACKENDS["FLASH_ATTN"], spec, layers, 8, 2, 1).num_kv_heads == 8  # 4 of 8: right


def test_context_parallelism_is_refused():
    from kvxferd.integrations.vllm.connector import KvxferdConnector

    parallel = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        KvxferdConnector(SimpleNamespace(parallel_config=parallel), None, None)


@pytest.mark.parametrize("kind, conv_dim_first, misdescribed", [
    ("MAMBA2", False, ""), ("MAMBA2", True, ""), ("MAMBA2", False, "orientation"),
    ("GDN_ATTN", False, ""), ("GDN_ATTN", True, ""), ("GDN_ATTN", False, "as MAMBA2"),
], ids=["SD", "DS", "negative-control", "GDN-SD", "GDN-DS", "GDN-negative-control"])
def test_state_pages_of_a_hybrid_model_are_addressed_where_vllm_binds_them(kind, conv_dim_first, misdescribed):
    """A hybrid model (full attention + Mamba2 or GDN, block-outer as vLLM requires for mixed pages): every
    conv and SSM state element is tagged through vLLM's own ``MambaBase.bind_kv_cache`` views and must be
    where kvxferd's description of the group (TP rank 1 of 2) puts it. Mamba2's conv channels are
    [x | B | C]; GDN's are [q | k | v] (vLLM's ``rearrange_mixed_qkv``:
    ``torch.split(mixed_qkv, [q_dim, k_dim, v_dim], dim=-1)``, q_dim = k_dim = key_dim // tp_size), its
    SSM state (value heads, value dim, key dim). The negative controls describe the conv state in the other
    orientation, or a GDN state as Mamba2's: the conv fields must miss."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    from kvxferd.integrations.vllm.states import mamba_group
    from tests.integrations.layer_tags import storage_bytes
    from tests.integrations.vllm_alloc import allocate_groups
    from tests.layout.brute import addresses

    heads, head_dim, state, groups, window = 4, 8, 16, 1, 3  # this rank's share (TP 2: 8 heads, 2 groups)
    conv_dim = heads * head_dim + 2 * groups * state
    if kind == "GDN_ATTN":  # vLLM's own shapes: 2 key heads of 16, 8 value heads of 8, over TP 2
        gdn_conv, gdn_ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(2, 2, 8, 16, 8, window + 1)
        assert sorted(gdn_conv) == sorted((conv_dim, window)) and gdn_ssm == (heads, head_dim, state)
    shapes = (((conv_dim, window) if conv_dim_first else (window, conv_dim)), (heads, head_dim, state))
    mamba = VllmMambaSpec(block_size=16, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
                          mamba_type=MambaAttentionBackendEnum[kind])
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    (_, layers), _ = allocate_groups([attention, mamba], 2, 4, KVCacheLayout.BLHNC)

    def tag(layer, block, state_index, flat, bits):
        return ((layer * 1009 + block) * 7919 + state_index * 104729 + flat * 2654435761) % (1 << bits)

    for l, view in enumerate(layers):  # vLLM's own split of each page into its states
        owner = SimpleNamespace(get_state_shape=lambda: shapes, get_state_dtype=lambda: mamba.dtypes)
        MambaBase.bind_kv_cache(owner, view)
        for i, (tensor, bits, np_type) in enumerate(zip(owner.kv_cache, (16, 32), (np.uint16, np.uint32))):
            blocks, size = tensor.shape[0], tensor[0].numel()
            values = tag(l, np.arange(blocks).reshape(-1, 1), i, np.arange(size).reshape(1, -1), bits).astype(np_type)
            target = tensor.view(torch.int16 if bits == 16 else torch.int32).reshape(blocks, size)
            target.copy_(torch.from_numpy(values.view(np.int16 if bits == 16 else np.int32)))

    described = mamba
    if misdescribed == "orientation":
        described = dataclasses.replace(mamba, shapes=(tuple(reversed(shapes[0])), shapes[1]))
    elif misdescribed:
        described = dataclasses.replace(mamba, mamba_type=MambaAttentionBackendEnum.MAMBA2)
    group = mamba_group([f"m{i}" for i in range(2)], layers, described,
                        conv_dim_first=conv_dim_first != (misdescribed == "orientation"), num_groups=2, tp_size=2,
                        tp_rank=1)
    region = group.spec().region(2, 1)
    memory = storage_bytes(layers[0])
    base = layers[0].data_ptr() - layers[0].untyped_storage().data_ptr()
    x_dim, bc_dim = heads * head_dim, groups * state
    channel_of = {  # (part, outer, inner) -> conv channel of this rank's state
        "conv_x": lambda outer, inner: outer * head_dim + inner,
        "conv_b": lambda outer, inner: x_dim + outer * state + inner,
        "conv_c": lambda outer, inner: x_dim + bc_dim + outer * state + inner}  # Mamba2: [x | B | C]
    if kind == "GDN_ATTN":  # vLLM's own split of a conv row into q, k and v (q, k: key heads; v: value heads)
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        split = SimpleNamespace(key_dim=2 * groups * state, value_dim=2 * x_dim, tp_size=2, head_k_dim=state,
                                head_v_dim=head_dim)
        q, k, v = (t[0, 0].numpy() for t in QwenGatedDeltaNetAttention.rearrange_mixed_qkv(
            split, torch.arange(conv_dim, dtype=torch.float32).reshape(1, -1)))
        channel_of = {"conv_b": lambda o, i: q[o, i].astype(np.int64), "conv_c": lambda o, i: k[o, i].astype(np.int64),
                      "conv_x": lambda o, i: v[o, i].astype(np.int64)}
    wrong = []
    for field in region.fields:
        layout, dims = field.layout, field.layout.dims
        c = {d: np.arange(layout.size(d)).reshape([-1 if i == j else 1 for j in range(len(dims))]) for i, d in enumerate(dims)}
        if field.name == "ssm":
            state_index, flat = 1, (c["heads"] * head_dim + c["head_dim"]) * state + c["state"]
        else:
            outer, inner = (c["heads"], c["head_dim"]) if field.name == "conv_x" else (c["groups"], c["state"])
            channel = channel_of[field.name](outer, inner)
            state_index, flat = 0, (channel * window + c["W"] if conv_dim_first else c["W"] * conv_dim + channel)
        item = layout.itemsize
        where = base + addresses(layout, dims) * item
        got = sum(memory[where + k].astype(np.uint64) << np.uint64(8 * k) for k in range(item))
        expected = tag(c["L"], c["B"], state_index, flat, 8 * item)
        if not np.array_equal(got, np.broadcast_to(expected, got.shape).astype(np.uint64)):
            wrong.append(field.name)
    assert wrong == (["conv_x", "conv_b", "conv_c"] if misdescribed else []), wrong


@pytest.mark.parametrize("change, named", [
    (dict(mamba_cache_mode="align"), "--no-enable-prefix-caching"),
    (dict(num_speculative_blocks=2), "speculative decoding"),
    (dict(mamba_type="MAMBA1", shapes=((3, 64), (64, 16))), "MAMBA1 state"),
])
def test_state_features_kvxferd_cannot_hold_are_refused_by_name(change, named):
    """Prefix caching of states and speculative slots give a request several state slots; Mamba1 pages
    are another layout: refused at start-up, naming them (never a read of the wrong slot)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    from kvxferd.integrations.vllm.states import mamba_group

    if "mamba_type" in change:
        change = {**change, "mamba_type": MambaAttentionBackendEnum[change["mamba_type"]]}
    spec = VllmMambaSpec(**{"block_size": 16, "shapes": ((3, 64), (4, 8, 16)), "dtypes": (torch.bfloat16, torch.float32),
                            **change})
    with pytest.raises(ValueError, match=named):
        mamba_group(["m0"], [], spec, conv_dim_first=False, num_groups=1)


def test_a_hybrid_attention_and_mamba2_request_reads_through_real_daemons(tmp_path):
    """Full attention and Mamba2 overlaying one block-outer allocation on each side: the request's attention
    blocks and its state page move through real daemons; the page arrives whole and nothing else is written."""
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    from kvxferd.integrations.vllm.states import mamba_group
    from tests.integrations.vllm_alloc import allocate_groups

    shapes = ((3, 64), (4, 8, 16))
    mamba = VllmMambaSpec(block_size=16, shapes=shapes, dtypes=(torch.bfloat16, torch.float32))
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    (pa, pm), _ = allocate_groups([full, mamba], 2, 8, KVCacheLayout.BLHNC)
    (da, dm), _ = allocate_groups([full, mamba], 2, 8, KVCacheLayout.BLHNC)
    ids = {"prefill": ([1, 2, 3], [5]), "decode": ([6, 7, 4], [2])}  # [attention blocks], [state page]; 0 is null
    tag_through_views(pa, 16, 0, block_ids=ids["prefill"][0])
    for layer in pm:  # the state page: any bytes, compared whole
        page = layer.view(torch.uint8)[ids["prefill"][1][0]]
        page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8))

    def groups(attention_layers, mamba_layers):
        names = ["a0", "a1"], ["m0", "m1"]
        described_ = [strided_group("full", names[0], attention_layers, full, 2),
                      mamba_group(names[1], mamba_layers, mamba, conv_dim_first=False, num_groups=1)]
        return described_, dict(zip(names[0] + names[1], attention_layers + mamba_layers))

    (prefill_groups, prefill_tensors), (decode_groups, decode_tensors) = groups(pa, pm), groups(da, dm)
    pd_read(tmp_path, [prefill_groups], [prefill_tensors], decode_groups, decode_tensors,
            remote_ids=ids["prefill"], decode_ids=ids["decode"], num_tokens=48)
    assert wrong_decode_blocks(da, 16, ids["decode"][0], ids["prefill"][0], 16, other_ids=ids["decode"][1]) == []
    for prefill_layer, decode_layer in zip(pm, dm):
        assert torch.equal(decode_layer.view(torch.uint8)[ids["decode"][1][0]],
                           prefill_layer.view(torch.uint8)[ids["prefill"][1][0]])
