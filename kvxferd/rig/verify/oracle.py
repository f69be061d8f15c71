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
from kvxferd.rig.verify.physical import SENTINEL, region_num_bytes, region_views, tags


def tagged_region(spec: CacheSpec, tp_size: int, tp_rank: int, region_key: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """A region buffer with every field element tagged, padding sentinel.

    ``region_key`` (e.g. group and layer) enters every tag, so bytes read
    from the wrong region are caught; ``out`` fills an existing buffer.
    """
    buf = np.full(region_num_bytes(spec, tp_size, tp_rank), SENTINEL, dtype=np.uint8) if out is None else out
    if out is not None:
        buf[...] = SENTINEL
    for view in region_views(spec, tp_size, tp_rank, buf):
        view.array[...] = tags(view.field, view.block, _keyed(view.coords, region_key), view.array.dtype)
    return buf


def _keyed(coords: dict[str, np.ndarray], region_key: int) -> dict[str, np.ndarray]:
    return {**coords, "region": np.asarray(region_key, dtype=np.int64)}


class BlockSource:
    """Local block ``local_block_ids[i]`` holds remote block ``remote_block_ids[i]`` whole."""

    def __init__(self, local_block_ids, remote_block_ids, num_local_blocks: int) -> None:
        self.block_map = np.full(num_local_blocks, -1, dtype=np.int64)
        self.block_map[np.asarray(local_block_ids, dtype=np.int64)] = np.asarray(remote_block_ids, dtype=np.int64)

    def __call__(self, block: np.ndarray, token):
        return self.block_map[block], token


class TokenSource:
    """Brute force on absolute token positions: which remote (block, token) each local one reads.

    Both id lists end at the block holding token ``num_tokens - 1``; a local
    token is read when the remote side lists its position and it lies before
    ``num_tokens`` rounded up to the smaller block size.
    """

    def __init__(self, local_block_ids, remote_block_ids, local_block_size: int, remote_block_size: int,
                 num_tokens: int | None, num_local_blocks: int) -> None:
        local_ids, remote_ids = np.asarray(local_block_ids, np.int64), np.asarray(remote_block_ids, np.int64)
        if num_tokens is None:  # equal block sizes: lists tail-aligned on blocks
            num_tokens = max(len(local_ids), len(remote_ids)) * local_block_size
        local_end = -(-num_tokens // local_block_size)
        remote_end = -(-num_tokens // remote_block_size)
        unit = min(local_block_size, remote_block_size)
        self.limit = -(-num_tokens // unit) * unit
        self.start_token = np.full(num_local_blocks, -1, dtype=np.int64)
        self.start_token[local_ids] = (local_end - len(local_ids) + np.arange(len(local_ids))) * local_block_size
        self.remote_at = np.full(remote_end + 1, -1, dtype=np.int64)
        self.remote_at[remote_end - len(remote_ids) + np.arange(len(remote_ids))] = remote_ids
        self.remote_block_size = remote_block_size

    def __call__(self, block: np.ndarray, token: np.ndarray):
        start = self.start_token[block]
        position = start + token
        index = np.clip(position // self.remote_block_size, 0, len(self.remote_at) - 1)
        remote = np.where((start >= 0) & (position < self.limit), self.remote_at[index], -1)
        return remote, position % self.remote_block_size


def expected_region(spec: CacheSpec, tp_size: int, tp_rank: int, source, region_key: int = 0) -> np.ndarray:
    """What a decode region must hold after its reads; ``source`` maps local to remote elements."""
    buf = np.full(region_num_bytes(spec, tp_size, tp_rank), SENTINEL, dtype=np.uint8)
    for view in region_views(spec, tp_size, tp_rank, buf):
        block = np.broadcast_to(view.block, view.array.shape)
        token = view.coords.get("N")
        remote_block, remote_token = source(block, None if token is None else np.broadcast_to(token, view.array.shape))
        coords = _keyed(view.coords, region_key)
        if token is not None:
            coords["N"] = remote_token
        wanted = remote_block >= 0
        values = tags(view.field, np.maximum(remote_block, 0), coords, view.array.dtype)
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
    if np.any(pairs.local_offsets < 0) or np.any(pairs.remote_offsets < 0):
        raise IndexError("a span starts before its region")
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
