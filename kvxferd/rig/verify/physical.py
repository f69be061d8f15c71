"""Brute-force oracle: coordinate-tagged caches, independent of the algebra.

This module describes each cache kind's memory the plain way (a numpy
reshape of the region's bytes, as an engine allocates it) and never uses
:mod:`kvxferd.layout`'s views, strides or spans. Every element holds a tag
derived from its *global logical* coordinates (field, block, global head or
channel, token, ...), so after a transfer the decode side must hold exactly
the tags computed from its own coordinates and the paired prefill block.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from kvxferd.layout.specs import AttentionSpec, CacheSpec, MambaSpec
from kvxferd.layout.strided import ITEMSIZES
from kvxferd.tp.shards import owned_range

UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SENTINEL = 0xA5

# Memory order of each attention layout; Bk/Nk are kernel blocks/tokens.
ATTENTION_AXES = {
    "packed_HND": ("Bk", "H", "Nk", "KV", "C"),
    "packed_NHD": ("Bk", "Nk", "H", "KV", "C"),
    "kv_per_head": ("Bk", "H", "KV", "Nk", "C"),
    "split_kv": ("Bk", "KV", "H", "Nk", "C"),
    "legacy": ("KV", "Bk", "Nk", "H", "C"),
    "cross_layer": ("Bk", "L", "H", "Nk", "KV", "C"),
    "mla": ("Bk", "Nk", "C"),
}


@dataclass(frozen=True, eq=False)
class TaggedView:
    """A typed numpy view of one field with its elements' logical coordinates."""

    field: str
    array: np.ndarray  # view into the region buffer, unsigned ints of the element size
    block: np.ndarray  # logical block id of each element (broadcastable)
    coords: dict[str, np.ndarray]  # global logical coordinate arrays (broadcastable)


def _axis_index(shape: tuple[int, ...], axis: int) -> np.ndarray:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.arange(shape[axis], dtype=np.int64).reshape(view)


def _global(local: np.ndarray, extent: int, tp_size: int, tp_rank: int) -> np.ndarray:
    return local + owned_range(extent, tp_size, tp_rank)[0]


def _kt_views(spec: AttentionSpec, tp_size: int, tp_rank: int, buf: np.ndarray) -> list[TaggedView]:
    """``kv_per_head_kt``: per kernel block and head, K as (C, Nk), then V as (Nk, C)."""
    kernel = spec.kernel_block_size or spec.block_size
    k = spec.block_size // kernel
    start, stop = owned_range(spec.num_kv_heads, tp_size, tp_rank)
    heads = buf.view(UINTS[ITEMSIZES[spec.dtype]]).reshape(spec.num_blocks * k, stop - start, 2, kernel * spec.head_size)
    views = []
    for name, part, axes in (("k", 0, ("Bk", "H", "C", "Nk")), ("v", 1, ("Bk", "H", "Nk", "C"))):
        sizes = {"Bk": spec.num_blocks * k, "H": stop - start, "Nk": kernel, "C": spec.head_size}
        shape = tuple(sizes[a] for a in axes)
        array = heads[:, :, part].reshape(shape)
        idx = {a: _axis_index(shape, i) for i, a in enumerate(axes)}
        coords = {"N": (idx["Bk"] % k) * kernel + idx["Nk"], "C": idx["C"], "H": idx["H"] + start}
        views.append(TaggedView(name, array, idx["Bk"] // k, coords))
    return views


def _strided_shape(spec: AttentionSpec, tp_size: int, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``strided``: the engine's own view ``(L, Bk, H, Nk, content)`` as (shape, element strides, first head)."""
    s = spec.strides
    kernel = spec.kernel_block_size or spec.block_size
    blocks = spec.num_blocks * (spec.block_size // kernel)
    start, stop = owned_range(1 if s.content == "latent" else spec.num_kv_heads, tp_size, tp_rank)
    content = spec.head_size * (1 if s.content in ("latent", "bytes") else 2)
    return ((spec.num_layers, blocks, stop - start, kernel, content), (s.layer, s.block, s.head, s.token, 1), start)


def _strided_views(spec: AttentionSpec, tp_size: int, tp_rank: int, buf: np.ndarray) -> list[TaggedView]:
    """``strided``: numpy's own strided view of the buffer (as vLLM's ``as_strided``), split per content."""
    shape, strides, start = _strided_shape(spec, tp_size, tp_rank)
    item = ITEMSIZES[spec.dtype]
    typed = buf.view(UINTS[item])
    full = np.lib.stride_tricks.as_strided(typed, shape, tuple(x * item for x in strides), writeable=True)
    layers, blocks, heads, kernel, _ = shape
    k, c = spec.block_size // kernel, spec.head_size
    content = spec.strides.content
    if content == "latent":
        parts = [("latent", full[:, :, 0], ("L", "Bk", "Nk", "C"))]
    elif content == "bytes":
        parts = [("content", full, ("L", "Bk", "H", "Nk", "C"))]
    elif content == "kv":
        parts = [("kv", full.reshape(layers, blocks, heads, kernel, 2, c), ("L", "Bk", "H", "Nk", "KV", "C"))]
    else:  # k_transposed: a head's kernel block is [K as (C, Nk) | V as (Nk, C)] (token stride 2C)
        per_head = full.reshape(layers, blocks, heads, 2 * kernel * c)
        parts = [("k", per_head[..., : kernel * c].reshape(layers, blocks, heads, c, kernel), ("L", "Bk", "H", "C", "Nk")),
                 ("v", per_head[..., kernel * c:].reshape(layers, blocks, heads, kernel, c), ("L", "Bk", "H", "Nk", "C"))]
    views = []
    for name, array, axes in parts:
        idx = {a: _axis_index(array.shape, i) for i, a in enumerate(axes)}
        coords = {"L": idx["L"], "N": (idx["Bk"] % k) * kernel + idx["Nk"], "C": idx["C"]}
        if "H" in idx:
            coords["H"] = idx["H"] + start
        if "KV" in idx:
            coords["KV"] = idx["KV"]
        views.append(TaggedView(name, array, idx["Bk"] // k, coords))
    return views


def _attention_views(spec: AttentionSpec, tp_size: int, tp_rank: int, buf: np.ndarray) -> list[TaggedView]:
    if spec.layout == "kv_per_head_kt":
        return _kt_views(spec, tp_size, tp_rank, buf)
    if spec.layout == "strided":
        return _strided_views(spec, tp_size, tp_rank, buf)
    axes = ATTENTION_AXES[spec.layout]
    kernel = spec.kernel_block_size or spec.block_size
    k = spec.block_size // kernel
    start, stop = owned_range(1 if spec.layout == "mla" else spec.num_kv_heads, tp_size, tp_rank)
    sizes = {"Bk": spec.num_blocks * k, "H": stop - start, "Nk": kernel, "KV": 2, "C": spec.head_size, "L": spec.num_layers}
    shape = tuple(sizes[a] for a in axes)
    array = buf.view(UINTS[ITEMSIZES[spec.dtype]]).reshape(shape)
    idx = {a: _axis_index(shape, i) for i, a in enumerate(axes)}
    coords = {"N": (idx["Bk"] % k) * kernel + idx["Nk"], "C": idx["C"]}
    if spec.layout != "mla":
        coords.update(H=idx["H"] + start, KV=idx["KV"])
    if "L" in idx:
        coords["L"] = idx["L"]
    name = "latent" if spec.layout == "mla" else "kv"
    return [TaggedView(name, array, idx["Bk"] // k, coords)]


def mamba_page_facts(spec: MambaSpec, tp_size: int, tp_rank: int) -> dict[str, int]:
    """Sizes of one rank's Mamba page, as the engine lays it out."""
    h0, h1 = owned_range(spec.num_heads, tp_size, tp_rank)
    g0, g1 = owned_range(spec.num_groups, tp_size, tp_rank)
    conv_size, ssm_size = ITEMSIZES[spec.conv_dtype], ITEMSIZES[spec.ssm_dtype]
    x_dim, bc_dim = (h1 - h0) * spec.head_dim, (g1 - g0) * spec.state_size
    conv_bytes = spec.conv_window * (x_dim + 2 * bc_dim) * conv_size
    ssm_start = (conv_bytes + ssm_size - 1) // ssm_size * ssm_size
    ssm_bytes = (h1 - h0) * spec.head_dim * spec.state_size * ssm_size
    align = np.lcm(conv_size, ssm_size)
    page = spec.page_bytes or int(-(-(ssm_start + ssm_bytes) // align) * align)
    return dict(h0=h0, heads=h1 - h0, g0=g0, groups=g1 - g0, x_dim=x_dim, bc_dim=bc_dim,
                conv_bytes=conv_bytes, ssm_start=ssm_start, ssm_bytes=ssm_bytes, page=page)


def _mamba_pages(spec: MambaSpec, page: int, buf: np.ndarray) -> np.ndarray:
    """``[L, B, page]`` byte views of the pages (L = 1 unless the region holds several layers)."""
    block = spec.block_stride or page
    if spec.layer_stride is None:
        return np.lib.stride_tricks.as_strided(buf, (1, spec.num_blocks, page), (0, block, 1), writeable=True)
    return np.lib.stride_tricks.as_strided(buf, (spec.num_layers, spec.num_blocks, page), (spec.layer_stride, block, 1),
                                           writeable=True)


def _mamba_views(spec: MambaSpec, tp_size: int, tp_rank: int, buf: np.ndarray) -> list[TaggedView]:
    f = mamba_page_facts(spec, tp_size, tp_rank)
    pages = _mamba_pages(spec, f["page"], buf)  # only the last axis is ever split below: views stay views
    layers = pages.shape[0]
    conv_dim = f["x_dim"] + 2 * f["bc_dim"]
    conv = pages[..., : f["conv_bytes"]].view(UINTS[ITEMSIZES[spec.conv_dtype]])
    if spec.conv_order == "DW":
        conv = conv.reshape(layers, spec.num_blocks, conv_dim, spec.conv_window).swapaxes(2, 3)  # still [L, B, W, D]
    else:
        conv = conv.reshape(layers, spec.num_blocks, spec.conv_window, conv_dim)
    layer = np.arange(layers, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    block = np.arange(spec.num_blocks, dtype=np.int64).reshape(1, -1, 1, 1, 1)
    window = np.arange(spec.conv_window, dtype=np.int64).reshape(1, 1, -1, 1, 1)
    with_layer = {"L": layer} if spec.layer_stride is not None else {}
    views = []
    # the oracle's own channel order, written out (not the builder's conv_part_channels)
    x_at, b_at, c_at = ((2 * f["bc_dim"], 0, f["bc_dim"]) if spec.conv_parts == "BCx"
                        else (0, f["x_dim"], f["x_dim"] + f["bc_dim"]))
    segments = (("conv_x", x_at, f["heads"], spec.head_dim, f["h0"], "heads", "head_dim"),
                ("conv_b", b_at, f["groups"], spec.state_size, f["g0"], "groups", "state"),
                ("conv_c", c_at, f["groups"], spec.state_size, f["g0"], "groups", "state"))
    for name, first, outer, inner, start, outer_name, inner_name in segments:
        seg = conv[..., first : first + outer * inner].reshape(layers, spec.num_blocks, spec.conv_window, outer, inner)
        coords = {"W": window, outer_name: np.arange(outer).reshape(1, 1, 1, -1, 1) + start,
                  inner_name: np.arange(inner).reshape(1, 1, 1, 1, -1), **with_layer}
        views.append(TaggedView(name, seg, block, coords))
    ssm = pages[..., f["ssm_start"] : f["ssm_start"] + f["ssm_bytes"]].view(UINTS[ITEMSIZES[spec.ssm_dtype]])
    ssm = ssm.reshape(layers, spec.num_blocks, f["heads"], spec.head_dim, spec.state_size)
    coords = {"heads": np.arange(f["heads"]).reshape(1, 1, -1, 1, 1) + f["h0"],
              "head_dim": np.arange(spec.head_dim).reshape(1, 1, 1, -1, 1),
              "state": np.arange(spec.state_size).reshape(1, 1, 1, 1, -1), **with_layer}
    views.append(TaggedView("ssm", ssm, block, coords))
    return views


def region_num_bytes(spec: CacheSpec, tp_size: int, tp_rank: int) -> int:
    """Bytes of one rank's region, computed from the spec alone."""
    if isinstance(spec, MambaSpec):
        page = mamba_page_facts(spec, tp_size, tp_rank)["page"]
        if spec.block_stride is None and spec.layer_stride is None:
            return spec.num_blocks * page
        return (spec.num_layers - 1) * (spec.layer_stride or 0) + (spec.num_blocks - 1) * (spec.block_stride or page) + page
    if spec.layout == "strided":  # one past the farthest element the engine's view reaches
        shape, strides, _ = _strided_shape(spec, tp_size, tp_rank)
        return (sum((n - 1) * x for n, x in zip(shape, strides)) + 1) * ITEMSIZES[spec.dtype]
    start, stop = owned_range(1 if spec.layout == "mla" else spec.num_kv_heads, tp_size, tp_rank)
    per_token = spec.head_size * (1 if spec.layout == "mla" else 2 * (stop - start))
    layers = spec.num_layers if spec.layout == "cross_layer" else 1
    return spec.num_blocks * spec.block_size * per_token * layers * ITEMSIZES[spec.dtype]


def region_views(spec: CacheSpec, tp_size: int, tp_rank: int, buf: np.ndarray) -> list[TaggedView]:
    """Tagged views of every field of a rank's region buffer (uint8, 1-D)."""
    if isinstance(spec, MambaSpec):
        return _mamba_views(spec, tp_size, tp_rank, buf)
    return _attention_views(spec, tp_size, tp_rank, buf)


def tags(field: str, block: np.ndarray, coords: dict[str, np.ndarray], dtype) -> np.ndarray:
    """Hash of (field, block, coordinates) truncated to ``dtype``'s width."""
    with np.errstate(over="ignore"):
        h = np.uint64(zlib.crc32(field.encode())) + block.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for i, name in enumerate(sorted(coords)):
            mult = np.uint64((0xC2B2AE3D27D4EB4F * (i + 3)) & 0xFFFFFFFFFFFFFFFF)
            h = (h ^ (coords[name].astype(np.uint64) * mult)) * np.uint64(0xBF58476D1CE4E5B9)
            h = h ^ (h >> np.uint64(31))
    return h.astype(dtype)
