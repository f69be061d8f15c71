"""Fill, copy and check coordinate-tagged caches byte for byte.

Used by the tests and the demo: prefill buffers are filled with tags of
their own block ids; decode buffers start as a sentinel; after the planned
copies every requested decode block must hold the tags of its paired
prefill block, and every other byte must still be the sentinel.
"""

from __future__ import annotations

import numpy as np

from kvxferd.layout.spans import SpanPairs
from kvxferd.layout.specs import CacheSpec
from kvxferd.verify.physical import SENTINEL, region_num_bytes, region_views, tags


def tagged_region(spec: CacheSpec, tp_size: int, tp_rank: int) -> np.ndarray:
    """A new region buffer with every field element tagged, padding sentinel."""
    buf = np.full(region_num_bytes(spec, tp_size, tp_rank), SENTINEL, dtype=np.uint8)
    for view in region_views(spec, tp_size, tp_rank, buf):
        view.array[...] = tags(view.field, view.block, view.coords, view.array.dtype)
    return buf


def expected_region(spec: CacheSpec, tp_size: int, tp_rank: int, local_block_ids, remote_block_ids) -> np.ndarray:
    """What a decode region must hold after reading ``remote_block_ids[i]`` into ``local_block_ids[i]``."""
    buf = np.full(region_num_bytes(spec, tp_size, tp_rank), SENTINEL, dtype=np.uint8)
    block_map = np.full(spec.num_blocks, -1, dtype=np.int64)
    block_map[np.asarray(local_block_ids, dtype=np.int64)] = remote_block_ids
    for view in region_views(spec, tp_size, tp_rank, buf):
        source = block_map[view.block]
        wanted = np.broadcast_to(source >= 0, view.array.shape)
        values = tags(view.field, np.maximum(source, 0), view.coords, view.array.dtype)
        view.array[wanted] = np.broadcast_to(values, view.array.shape)[wanted]
    return buf


def gather_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Byte indices covered by spans, in span order (vectorised)."""
    total = int(lengths.sum())
    starts = np.repeat(offsets - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(total, dtype=np.int64)


def apply_span_copies(src: np.ndarray, dst: np.ndarray, pairs: SpanPairs, write_counts: np.ndarray | None = None) -> None:
    """Copy ``src[remote spans]`` into ``dst[local spans]`` like a NIXL READ would."""
    if np.any(pairs.local_offsets + pairs.lengths > len(dst)) or np.any(pairs.remote_offsets + pairs.lengths > len(src)):
        raise IndexError("a span runs past the end of its region")
    dst_idx = gather_index(pairs.local_offsets, pairs.lengths)
    dst[dst_idx] = src[gather_index(pairs.remote_offsets, pairs.lengths)]
    if write_counts is not None:
        write_counts += np.bincount(dst_idx, minlength=len(dst)).astype(write_counts.dtype)


def describe_byte(spec: CacheSpec, tp_size: int, tp_rank: int, buf: np.ndarray, byte: int) -> str:
    """Which field element (block and coordinates) holds byte ``byte``."""
    base = buf.__array_interface__["data"][0]
    for view in region_views(spec, tp_size, tp_rank, buf):
        arr = view.array
        offsets = arr.__array_interface__["data"][0] - base + sum(
            np.arange(n, dtype=np.int64).reshape([-1 if j == i else 1 for j in range(arr.ndim)]) * s
            for i, (n, s) in enumerate(zip(arr.shape, arr.strides))
        )
        hit = np.argwhere((offsets <= byte) & (byte < offsets + arr.itemsize))
        if len(hit):
            index = tuple(int(i) for i in hit[0])
            block = int(np.broadcast_to(view.block, arr.shape)[index])
            coords = {k: int(np.broadcast_to(v, arr.shape)[index]) for k, v in view.coords.items()}
            return f"field {view.field} physical index {index} block {block} coords {coords}"
    return "padding (no field)"


def first_mismatch(spec: CacheSpec, tp_size: int, tp_rank: int, actual: np.ndarray, expected: np.ndarray) -> str | None:
    """None when equal; else a readable description of the first wrong byte."""
    wrong = np.flatnonzero(actual != expected)
    if not wrong.size:
        return None
    byte = int(wrong[0])
    where = describe_byte(spec, tp_size, tp_rank, expected, byte)
    return (f"{wrong.size} wrong bytes on rank {tp_rank}/{tp_size}; first at byte {byte}: "
            f"expected {expected[byte]:#04x}, got {actual[byte]:#04x} ({where})")
