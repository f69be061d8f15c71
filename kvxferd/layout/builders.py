"""Builders for the standard cache layouts (see DESIGN.md).

Each builder returns the :class:`Region` one TP rank registers. Attention
regions are described with the logical dims ``(B, H, N, KV, C)`` whatever
their memory order, so any two of them can be paired::

    packed      (B, H, N, 2C)   = (B, H, N, KV, C)   K|V packed in the content dim
    kv_per_head (B, H, 2N, C)   = (B, H, KV, N, C)   per head: every token's K, then every token's V
    kv_per_head_kt                                   per head: K transposed (C, N), then V (N, C):
                                                     two fields, "k" and "v" (vLLM's CPU "vec" kernels)
    split_kv    (B, 2H, N, C)   = (B, KV, H, N, C)   fp8 / nvfp4: K heads, then V heads
    legacy      (2, B, N, H, C) = (KV, B, N, H, C)   K/V outermost, token-major
    cross_layer (B, L, H, N, 2C)                     all layers of a block together
    mla         (B, N, C)                            latent, replicated on every rank
    strided     (L, B, H, N, <content>) in any order one view over every layer of a group, strides as
                                                     given (vLLM >= 0.32: LBHNC, LBNHC, LHBNC, BLHNC, ...)

``kernel_block_size`` < ``block_size`` stores each logical block as
consecutive kernel blocks; the returned layout is already the logical view.
nvfp4 is described in bytes: dtype ``uint8``, ``head_size`` = packed bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.region import Field, Region, Shard
from kvxferd.layout.strided import ITEMSIZES, Layout, positive_int


def contiguous(dims, shape, dtype: str, offset: int = 0) -> Layout:
    """Row-major layout of ``shape`` with named ``dims``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return Layout.create(dims, shape, tuple(reversed(strides)), dtype, offset)


def _kernel_split(block_size: int, kernel_block_size: int | None) -> tuple[int, int]:
    """(kernel blocks per logical block, tokens per kernel block)."""
    positive_int(block_size, "block_size")
    kernel = block_size if kernel_block_size is None else positive_int(kernel_block_size, "kernel_block_size")
    if block_size % kernel:
        raise InvalidArgumentError("kernel_block_size", f"{kernel} does not divide block_size {block_size}")
    return block_size // kernel, kernel


def _attention(kind, physical_dims, num_blocks, num_kv_heads, block_size, head_size, dtype,
               tp_size, tp_rank, kernel_block_size, extra=None) -> Region:
    shard = Shard("H", positive_int(num_kv_heads, "num_kv_heads"), tp_size, tp_rank)
    k, kernel = _kernel_split(block_size, kernel_block_size)
    sizes = {"B": positive_int(num_blocks, "num_blocks") * k, "H": shard.local_extent, "N": kernel,
             "KV": 2, "C": positive_int(head_size, "head_size"), **(extra or {})}
    shape = [sizes[d] for d in physical_dims]
    layout = contiguous(physical_dims, shape, dtype).group_blocks(k)
    return Region(kind, (Field("kv", layout, shard),), math.prod(shape) * layout.itemsize)


def packed_attention(num_blocks, num_kv_heads, block_size, head_size, dtype="bfloat16", *,
                     tp_size=1, tp_rank=0, order="HND", kernel_block_size=None) -> Region:
    """Blocks-first attention with K|V packed in the content dim (HND or NHD)."""
    orders = {"HND": ("B", "H", "N", "KV", "C"), "NHD": ("B", "N", "H", "KV", "C")}
    if order not in orders:
        raise InvalidArgumentError("order", f"must be one of {sorted(orders)}, got {order!r}")
    return _attention(f"packed_{order}", orders[order], num_blocks, num_kv_heads, block_size, head_size,
                      dtype, tp_size, tp_rank, kernel_block_size)


def split_kv_attention(num_blocks, num_kv_heads, block_size, head_size, dtype="float8_e4m3fn", *,
                       tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """fp8 / nvfp4 attention: ``(B, 2H, N, C)``, all K heads then all V heads."""
    return _attention("split_kv", ("B", "KV", "H", "N", "C"), num_blocks, num_kv_heads, block_size,
                      head_size, dtype, tp_size, tp_rank, kernel_block_size)


def kv_per_head_attention(num_blocks, num_kv_heads, block_size, head_size, dtype="bfloat16", *,
                          tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """``(B, H, KV, N, C)``: within a block and head, K of every token, then V (vLLM's CPU attention)."""
    return _attention("kv_per_head", ("B", "H", "KV", "N", "C"), num_blocks, num_kv_heads, block_size,
                      head_size, dtype, tp_size, tp_rank, kernel_block_size)


def kv_per_head_kt_attention(num_blocks, num_kv_heads, block_size, head_size, dtype="bfloat16", *,
                             tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """vLLM's CPU attention with its ``vec`` kernels: per kernel block and head, K transposed, then V.

    ::

        kernel block b, head h:  [ K: c0: t0 t1 .. tN-1 | c1: t0 .. | .. ] [ V: t0: c0 .. cC-1 | t1: .. ]

    K and V order (token, channel) differently, so they are two fields; a
    sub-block of tokens (when the two sides' block sizes differ) is then one
    run of tokens per channel of K, and one run per head of V.
    """
    shard = Shard("H", positive_int(num_kv_heads, "num_kv_heads"), tp_size, tp_rank)
    k, kernel = _kernel_split(block_size, kernel_block_size)
    blocks, heads, channels = positive_int(num_blocks, "num_blocks") * k, shard.local_extent, positive_int(head_size, "head_size")
    head_stride = 2 * kernel * channels
    block_stride = heads * head_stride
    key = Layout.create(("B", "H", "C", "N"), (blocks, heads, channels, kernel),
                        (block_stride, head_stride, kernel, 1), dtype).group_blocks(k)
    value = Layout.create(("B", "H", "N", "C"), (blocks, heads, kernel, channels),
                          (block_stride, head_stride, channels, 1), dtype, kernel * channels).group_blocks(k)
    return Region("kv_per_head_kt", (Field("k", key, shard), Field("v", value, shard)),
                  blocks * block_stride * key.itemsize)


def legacy_attention(num_blocks, num_kv_heads, block_size, head_size, dtype="bfloat16", *,
                     tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """Legacy ``(2, B, N, H, C)``: K/V outermost, token-major."""
    return _attention("legacy", ("KV", "B", "N", "H", "C"), num_blocks, num_kv_heads, block_size,
                      head_size, dtype, tp_size, tp_rank, kernel_block_size)


def cross_layer_attention(num_blocks, num_layers, num_kv_heads, block_size, head_size, dtype="bfloat16", *,
                          tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """One region for all layers: ``(B, L, H, N, KV, C)``."""
    return _attention("cross_layer", ("B", "L", "H", "N", "KV", "C"), num_blocks, num_kv_heads, block_size,
                      head_size, dtype, tp_size, tp_rank, kernel_block_size,
                      extra={"L": positive_int(num_layers, "num_layers")})


def mla_attention(num_blocks, block_size, latent_size, dtype="bfloat16", *, tp_size=1, tp_rank=0,
                  kernel_block_size=None) -> Region:
    """MLA latent cache ``(B, N, C)``: no head dim, the same on every TP rank."""
    Shard("H", 1, tp_size, tp_rank)  # validates the rank; MLA itself is unsharded
    k, kernel = _kernel_split(block_size, kernel_block_size)
    shape = (positive_int(num_blocks, "num_blocks") * k, kernel, positive_int(latent_size, "latent_size"))
    layout = contiguous(("B", "N", "C"), shape, dtype).group_blocks(k)
    return Region("mla", (Field("latent", layout, None),), math.prod(shape) * layout.itemsize)


CONV_PARTS = ("xBC", "BCx")


def conv_part_channels(conv_parts: str, x_dim: int, bc_dim: int) -> tuple[int, int, int]:
    """First conv channel of x, B and C in a rank's page (``x_dim``, ``bc_dim``: the rank's widths)."""
    if conv_parts == "BCx":
        return 2 * bc_dim, 0, bc_dim
    return 0, x_dim, x_dim + bc_dim


def mamba_page(num_blocks, *, num_heads, head_dim, num_groups, state_size, conv_window,
               conv_dtype="bfloat16", ssm_dtype="float32", tp_size=1, tp_rank=0,
               page_bytes=None, conv_order="WD", block_stride=None, num_layers=1, layer_stride=None,
               conv_parts="xBC") -> Region:
    """Mamba2 / GDN state page per block: conv state, then SSM state ``(heads, head_dim, state)``.

    conv channels, x sharded by heads, B and C by groups (replicated when groups < TP)::

        xBC (Mamba2):  [ x (heads*head_dim) | B (groups*state) | C (groups*state) ]
        BCx (GDN):     [ q = B (k heads*k dim) | k = C (k heads*k dim) | v = x (v heads*v dim) ]

    (GDN's SSM state is (v heads, v dim, k dim): heads, head_dim and state.)
    ``conv_order`` "WD" stores window rows of channels, "DW" channel rows.

    Pages follow each other unless ``block_stride`` (bytes) says otherwise;
    with ``layer_stride`` (bytes) the region holds ``num_layers`` layers and
    every field gains an outer ``L`` dim (vLLM 0.32: a Mamba layer's pages sit
    a whole block row apart, the layers of a block next to each other).
    """
    heads = Shard("heads", positive_int(num_heads, "num_heads"), tp_size, tp_rank)
    groups = Shard("groups", positive_int(num_groups, "num_groups"), tp_size, tp_rank)
    for name, value in (("head_dim", head_dim), ("state_size", state_size), ("conv_window", conv_window),
                        ("num_blocks", num_blocks)):
        positive_int(value, name)
    if conv_order not in ("WD", "DW"):
        raise InvalidArgumentError("conv_order", f"must be 'WD' or 'DW', got {conv_order!r}")
    if conv_parts not in CONV_PARTS:
        raise InvalidArgumentError("conv_parts", f"must be one of {CONV_PARTS}, got {conv_parts!r}")
    for name, dtype in (("conv_dtype", conv_dtype), ("ssm_dtype", ssm_dtype)):
        if dtype not in ITEMSIZES:
            raise InvalidArgumentError(name, f"unknown dtype {dtype!r}")
    conv_size, ssm_size = ITEMSIZES[conv_dtype], ITEMSIZES[ssm_dtype]
    x_dim, bc_dim = heads.local_extent * head_dim, groups.local_extent * state_size
    conv_dim = x_dim + 2 * bc_dim
    ssm_start = -(-conv_window * conv_dim * conv_size // ssm_size) * ssm_size  # align up
    needed = ssm_start + heads.local_extent * head_dim * state_size * ssm_size
    align = math.lcm(conv_size, ssm_size)  # pages tile whole elements of both states
    page = -(-needed // align) * align if page_bytes is None else positive_int(page_bytes, "page_bytes")
    if page < needed or page % conv_size or page % ssm_size:
        raise InvalidArgumentError("page_bytes", f"{page} must be >= {needed} and a multiple of both element sizes")
    window_stride, channel_stride = (conv_dim, 1) if conv_order == "WD" else (1, conv_window)
    block = page if block_stride is None else positive_int(block_stride, "block_stride")
    layers = positive_int(num_layers, "num_layers")
    if layer_stride is None and layers != 1:
        raise InvalidArgumentError("layer_stride", f"{layers} layers in one region need a layer stride")
    for name, stride in (("block_stride", block), ("layer_stride", layer_stride or 0)):
        if stride % align:
            raise InvalidArgumentError(name, f"{stride} bytes is not a multiple of both element sizes ({align})")
    outer = ((("L",), (layers,), (layer_stride,)) if layer_stride is not None else ((), (), ()))

    def field(name, dims, shape, strides, dtype, offset, shard):
        size = ITEMSIZES[dtype]
        strides = tuple(x // size for x in outer[2]) + (block // size,) + strides
        return Field(name, Layout.create(outer[0] + ("B",) + dims, outer[1] + (num_blocks,) + shape, strides, dtype,
                                         offset), shard)

    def conv_field(name, inner_dims, shard, inner_sizes, first_channel):
        return field(name, ("W",) + inner_dims, (conv_window,) + inner_sizes,
                     (window_stride, inner_sizes[1] * channel_stride, channel_stride), conv_dtype,
                     first_channel * channel_stride, shard)

    x_at, b_at, c_at = conv_part_channels(conv_parts, x_dim, bc_dim)
    fields = (
        conv_field("conv_x", ("heads", "head_dim"), heads, (heads.local_extent, head_dim), x_at),
        conv_field("conv_b", ("groups", "state"), groups, (groups.local_extent, state_size), b_at),
        conv_field("conv_c", ("groups", "state"), groups, (groups.local_extent, state_size), c_at),
        field("ssm", ("heads", "head_dim", "state"), (heads.local_extent, head_dim, state_size),
              (head_dim * state_size, state_size, 1), ssm_dtype, ssm_start // ssm_size, heads),
    )
    if block_stride is None and layer_stride is None:
        return Region("mamba", fields, num_blocks * page)
    # Pages of one layer and block must not meet another's (a state may not run into the next page).
    Layout.create(outer[0] + ("B", "P"), outer[1] + (num_blocks, page), tuple(outer[2]) + (block, 1), "uint8")
    return Region("mamba", fields, (layers - 1) * (layer_stride or 0) + (num_blocks - 1) * block + page)


CONTENTS = ("kv", "k_transposed", "latent", "bytes")
MAX_REGION_BYTES = 1 << 50  # 1 PiB: far above any cache, far below int64


@dataclass(frozen=True)
class CacheStrides:
    """Element strides of a cache stored as one view over all layers of a group (vLLM >= 0.32).

    The engine allocates ``[L, B, H, N, <content>]`` in any physical order
    and gives the strides of ``L``, kernel block ``B``, head ``H`` and token
    ``N``; the content of one (head, token) is contiguous. ``content`` says
    what it holds::

        kv            [ K: C | V: C ]                 per (head, token)
        k_transposed  per (head, kernel block): [ K: C x N | V: N x C ]   (vLLM's CPU "vec" kernels;
                                                                           token stride must be 2C)
        latent        [ C ]  per token, no heads (MLA)
        bytes         [ C ]  per (head, token), moved whole: K, V and whatever the engine keeps beside them
                             (quantisation scales); dtype uint8, C in bytes

    ``head_size`` is C for ``latent`` and ``bytes``, half of it for the others.
    """

    content: str
    layer: int
    block: int
    head: int
    token: int

    def __post_init__(self) -> None:
        if self.content not in CONTENTS:
            raise InvalidArgumentError("strides.content", f"must be one of {CONTENTS}, got {self.content!r}")
        for name in ("layer", "block", "head", "token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"strides.{name}", f"must be a non-negative integer, got {value!r}")


ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM's KVCacheLayout names


def order_strides(order: str, content: str, *, num_layers: int, num_blocks: int, num_heads: int, block_size: int,
                  head_size: int) -> CacheStrides:
    """The strides of a dense cache stored in physical ``order`` (one of :data:`ORDERS`), as vLLM allocates it.

    ``num_blocks`` and ``block_size`` are kernel blocks and their tokens;
    ``num_heads`` is this rank's (1 for a latent).
    """
    if order not in ORDERS:
        raise InvalidArgumentError("order", f"must be one of {ORDERS}, got {order!r}")
    content_size = head_size if content in ("latent", "bytes") else 2 * head_size
    sizes = {"L": num_layers, "B": num_blocks, "H": 1 if content == "latent" else num_heads, "N": block_size,
             "C": content_size}
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    return CacheStrides(content, strides["L"], strides["B"], strides["H"], strides["N"])


def strided_attention(num_blocks, num_layers, num_kv_heads, block_size, head_size, dtype, strides: CacheStrides, *,
                      tp_size=1, tp_rank=0, kernel_block_size=None) -> Region:
    """One region for ``num_layers`` layers stored with ``strides`` (element 0: layer 0, block 0, head 0, token 0).

    ::

        BLHNC, 2 layers, 2 heads:   | blk 0 [ L0: h0 h1 | L1: h0 h1 ] | blk 1 [ L0: h0 h1 | L1: h0 h1 ] | ...
        LBNHC:                      | L0 [ blk 0: n0 (h0 h1) n1 (h0 h1) .. | blk 1 .. ] | L1 [ .. ] |

    Whatever the order, the field's dims are ``(L, B, H, N, KV, C)`` (no
    ``H`` for a latent, no ``KV`` for a latent or whole bytes), so any two
    orders of one content pair; the layout algebra finds the spans.
    Overlapping strides are refused.
    """
    k, kernel = _kernel_split(block_size, kernel_block_size)
    blocks, channels = positive_int(num_blocks, "num_blocks") * k, positive_int(head_size, "head_size")
    layers = positive_int(num_layers, "num_layers")
    s = strides
    if s.content == "latent":
        Shard("H", 1, tp_size, tp_rank)  # validates the rank; a latent is the same on every rank
        latent = Layout.create(("L", "B", "N", "C"), (layers, blocks, kernel, channels), (s.layer, s.block, s.token, 1),
                               dtype)
        fields = (Field("latent", latent.group_blocks(k), None),)
    else:
        shard = Shard("H", positive_int(num_kv_heads, "num_kv_heads"), tp_size, tp_rank)
        outer = (("L", "B", "H"), (layers, blocks, shard.local_extent), (s.layer, s.block, s.head))
        if s.content == "bytes":
            whole = Layout.create(outer[0] + ("N", "C"), outer[1] + (kernel, channels), outer[2] + (s.token, 1), dtype)
            fields = (Field("content", whole.group_blocks(k), shard),)
        elif s.content == "kv":
            kv = Layout.create(outer[0] + ("N", "KV", "C"), outer[1] + (kernel, 2, channels),
                               outer[2] + (s.token, channels, 1), dtype)
            fields = (Field("kv", kv.group_blocks(k), shard),)
        else:
            if s.token != 2 * channels:
                raise InvalidArgumentError("strides.token", f"k_transposed needs each head's tokens packed (token stride "
                                                            f"{2 * channels}), got {s.token}")
            # K and V of one head share a packed chunk: chunks of two heads, blocks or layers must not meet.
            Layout.create(outer[0] + ("X",), outer[1] + (2 * kernel * channels,), outer[2] + (1,), dtype)
            key = Layout.create(outer[0] + ("C", "N"), outer[1] + (channels, kernel), outer[2] + (kernel, 1), dtype)
            value = Layout.create(outer[0] + ("N", "C"), outer[1] + (kernel, channels), outer[2] + (channels, 1), dtype,
                                  kernel * channels)
            fields = (Field("k", key.group_blocks(k), shard), Field("v", value.group_blocks(k), shard))
    num_bytes = max(f.layout.end_bytes for f in fields)
    if num_bytes > MAX_REGION_BYTES:  # block tables are int64 byte offsets: stay far from wrapping
        raise InvalidArgumentError("strides", f"the region would span {num_bytes} bytes (at most {MAX_REGION_BYTES})")
    return Region("strided", fields, num_bytes)
