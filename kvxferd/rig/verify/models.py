"""Model presets: the cache groups of a prefill and a decode engine.

Used by the tests, the demo and the benchmarks, so they all speak about
the same models. Sizes are small by default (host memory, 2 cores); every
one can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.specs import SELF_PAIRED_LAYOUTS, AttentionSpec, MambaSpec
from kvxferd.layout.strided import positive_int
from kvxferd.plan.groups import CacheGroup

MODELS = ("gqa", "fp8", "mla", "swa", "hybrid")
DECODE_LAYOUTS = {"packed": "packed_HND", "nhd": "packed_NHD", "kvhead": "kv_per_head", "legacy": "legacy",
                  "cpu": "kv_per_head_kt"}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a preset; block sizes default to ``block_size`` on both sides."""

    num_layers: int = 2
    num_kv_heads: int = 8
    head_size: int = 64
    block_size: int = 16
    kernel_block_size: int | None = None  # decode side's kernel blocks
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    num_blocks: int = 64  # decode side; prefill holds as many tokens
    layout: str = "packed"  # decode attention layout (prefill: packed HND, or the same when it pairs only with itself)

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **changes)


def model_groups(model: str, shape: ModelShape) -> tuple[tuple[CacheGroup, ...], tuple[CacheGroup, ...]]:
    """``(prefill_groups, decode_groups)`` of preset ``model``."""
    if model not in MODELS:
        raise InvalidArgumentError("model", f"must be one of {MODELS}, got {model!r}")
    if shape.layout not in DECODE_LAYOUTS:
        raise InvalidArgumentError("layout", f"must be one of {sorted(DECODE_LAYOUTS)}, got {shape.layout!r}")
    prefill_bs = positive_int(shape.prefill_block_size or shape.block_size, "prefill_block_size")
    decode_bs = positive_int(shape.decode_block_size or shape.block_size, "decode_block_size")
    decode_blocks = positive_int(shape.num_blocks, "num_blocks")
    prefill_blocks = max(1, decode_blocks * decode_bs // prefill_bs)
    layers = positive_int(shape.num_layers, "num_layers")
    decode_layout = DECODE_LAYOUTS[shape.layout]
    prefill_layout = decode_layout if decode_layout in SELF_PAIRED_LAYOUTS else "packed_HND"
    base = AttentionSpec(prefill_layout, num_blocks=prefill_blocks, num_kv_heads=shape.num_kv_heads,
                         head_size=shape.head_size, block_size=prefill_bs)
    decode_attn = dict(num_blocks=decode_blocks, block_size=decode_bs, kernel_block_size=shape.kernel_block_size)

    def pair(kind, prefill_spec, decode_layout=None):
        decode_spec = prefill_spec.with_(layout=decode_layout or prefill_spec.layout, **decode_attn)
        return CacheGroup(kind, prefill_spec, layers), CacheGroup(kind, decode_spec, layers)

    if model == "gqa":
        pairs = [pair("full", base, decode_layout)]
    elif model == "swa":
        pairs = [pair("full", base, decode_layout), pair("swa", base, decode_layout)]
    elif model == "fp8":
        pairs = [pair("full", base.with_(layout="split_kv", dtype="float8_e4m3fn"))]
    elif model == "mla":
        pairs = [pair("mla", base.with_(layout="mla", head_size=shape.head_size * 4 + 64))]
    else:  # hybrid: attention layers plus Mamba state pages (one page per request)
        mamba = MambaSpec(num_blocks=decode_blocks, num_heads=shape.num_kv_heads * 4, head_dim=32, num_groups=1,
                          state_size=64, conv_window=4)
        pairs = [pair("full", base, decode_layout), (CacheGroup("mamba", mamba, layers), CacheGroup("mamba", mamba, layers))]
    return tuple(p for p, _ in pairs), tuple(d for _, d in pairs)


def random_request(request_id: str, prefill_groups, decode_groups, num_tokens: int, rng, *,
                   cached_tokens: int = 0, window_tokens: int | None = None, contiguous: bool = True):
    """A valid request for ``num_tokens`` tokens with fresh block ids per group.

    ``cached_tokens`` (a decode prefix-cache hit) shortens the decode lists
    of full-attention and MLA groups; ``window_tokens`` keeps only the last
    blocks of sliding-window groups on both sides. Ids are runs of
    consecutive blocks on both sides when ``contiguous`` (how allocators
    often hand them out); otherwise both sides are shuffled.
    """
    from kvxferd.plan.engine import ReadRequest

    local_ids, remote_ids = [], []
    for prefill, decode in zip(prefill_groups, decode_groups):
        if decode.block_size is None:  # state pages: one per request
            local_ids.append(rng.choice(decode.spec.num_blocks, 1))
            remote_ids.append(rng.choice(prefill.spec.num_blocks, 1))
            continue
        n_remote = -(-num_tokens // prefill.block_size)
        n_local = -(-num_tokens // decode.block_size)
        if decode.kind in ("full", "mla"):
            n_local -= cached_tokens // decode.block_size
        if decode.kind == "swa" and window_tokens is not None:
            n_local = min(n_local, -(-window_tokens // decode.block_size) + 1)
            n_remote = min(n_remote, -(-window_tokens // prefill.block_size) + 1)
        remote_ids.append(_block_ids(prefill.spec.num_blocks, n_remote, contiguous, rng))
        local_ids.append(_block_ids(decode.spec.num_blocks, n_local, contiguous, rng))
    return ReadRequest(request_id, f"{request_id}@prefill", tuple(local_ids), tuple(remote_ids), num_tokens)


def _block_ids(num_blocks: int, count: int, contiguous: bool, rng) -> np.ndarray:
    if count > num_blocks:
        raise ValueError(f"a request needs {count} blocks but the cache has {num_blocks}")
    if contiguous:
        first = int(rng.integers(0, num_blocks - count + 1))
        return np.arange(first, first + count)
    return rng.permutation(num_blocks)[:count]
