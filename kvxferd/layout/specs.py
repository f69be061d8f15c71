"""Cache specs: the facts of one cache group, turned into a rank's region.

A spec is what an engine (or a test, the demo, a benchmark) knows about one
cache: its kind and sizes. ``spec.region(tp_size, tp_rank)`` gives the
region that rank registers. Specs are plain data so they can be compared,
printed and sent over the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout import builders
from kvxferd.layout.builders import CacheStrides
from kvxferd.layout.region import Region

ATTENTION_LAYOUTS = ("packed_HND", "packed_NHD", "kv_per_head", "kv_per_head_kt", "split_kv", "legacy", "cross_layer",
                     "mla", "strided")
# Layouts whose regions have fields of their own ("k" and "v", "latent", ...): they pair only with themselves
# (a "strided" region, which holds every layer, also pairs with "cross_layer" when its content is "kv").
SELF_PAIRED_LAYOUTS = ("kv_per_head_kt", "cross_layer", "mla", "strided")


@dataclass(frozen=True)
class AttentionSpec:
    """An attention (or MLA) cache; ``head_size`` is the latent size for MLA."""

    layout: str
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    kernel_block_size: int | None = None
    dtype: str = "bfloat16"
    num_layers: int = 1  # stored inside the region only for "cross_layer" and "strided"
    strides: CacheStrides | None = None  # "strided" only: this rank's strides and what a (head, token) holds

    def region(self, tp_size: int = 1, tp_rank: int = 0) -> Region:
        common = dict(tp_size=tp_size, tp_rank=tp_rank, kernel_block_size=self.kernel_block_size)
        head = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_size, self.dtype)
        if self.layout in ("packed_HND", "packed_NHD"):
            return builders.packed_attention(*head, order=self.layout[-3:], **common)
        if self.layout == "kv_per_head":
            return builders.kv_per_head_attention(*head, **common)
        if self.layout == "kv_per_head_kt":
            return builders.kv_per_head_kt_attention(*head, **common)
        if self.layout == "split_kv":
            return builders.split_kv_attention(*head, **common)
        if self.layout == "legacy":
            return builders.legacy_attention(*head, **common)
        if self.layout == "cross_layer":
            return builders.cross_layer_attention(self.num_blocks, self.num_layers, *head[1:], **common)
        if self.layout == "mla":
            return builders.mla_attention(self.num_blocks, self.block_size, self.head_size, self.dtype, **common)
        if self.layout == "strided":
            if self.strides is None:
                raise InvalidArgumentError("strides", "layout 'strided' needs the cache's strides")
            return builders.strided_attention(self.num_blocks, self.num_layers, *head[1:], self.strides, **common)
        raise InvalidArgumentError("layout", f"must be one of {ATTENTION_LAYOUTS}, got {self.layout!r}")

    @property
    def is_latent(self) -> bool:
        """An MLA latent: no heads, the same on every TP rank."""
        return self.layout == "mla" or (self.strides is not None and self.strides.content == "latent")

    @property
    def sharded_extents(self) -> tuple[int, ...]:
        return (1,) if self.is_latent else (self.num_kv_heads,)

    def with_(self, **changes) -> "AttentionSpec":
        return replace(self, **changes)


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba2 / GDN state cache: one page per block."""

    num_blocks: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_window: int
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    conv_order: str = "WD"
    page_bytes: int | None = None
    block_stride: int | None = None  # bytes between one block's page and the next's (default: page_bytes)
    num_layers: int = 1  # layers inside the region, layer_stride bytes apart (vLLM >= 0.32: one region per group)
    layer_stride: int | None = None
    conv_parts: str = "xBC"  # the conv channels' order: xBC (Mamba2) or BCx (GDN's q | k | v)

    layout = "mamba"

    def region(self, tp_size: int = 1, tp_rank: int = 0) -> Region:
        return builders.mamba_page(
            self.num_blocks, num_heads=self.num_heads, head_dim=self.head_dim, num_groups=self.num_groups,
            state_size=self.state_size, conv_window=self.conv_window, conv_dtype=self.conv_dtype,
            ssm_dtype=self.ssm_dtype, tp_size=tp_size, tp_rank=tp_rank, page_bytes=self.page_bytes,
            conv_order=self.conv_order, block_stride=self.block_stride, num_layers=self.num_layers,
            layer_stride=self.layer_stride, conv_parts=self.conv_parts,
        )

    @property
    def sharded_extents(self) -> tuple[int, ...]:
        return (self.num_heads, self.num_groups)

    def with_(self, **changes) -> "MambaSpec":
        return replace(self, **changes)


CacheSpec = AttentionSpec | MambaSpec
