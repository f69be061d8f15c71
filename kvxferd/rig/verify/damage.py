"""Damage a held block in a holder's memory, and undo it: the faults only a hold's digests can catch (issue #59).

Where: the request's last token (held in its last block of each group), this
rank's first head, channel 0, layer 0 of each region. The last token is read
whatever the reader's TP rank, block size, prefix hit or window (a prefix hit
ends before it; a window ends on it), so some decode rank reads the change::

    region (one layer, or L of them)      last block b of field 0
    [ ... | ... e ... | ... ]              e = token (num_tokens - 1) mod block size, head 0, channel 0
              ^ block_table_bytes[b] + field offset + that token's place (its axes' strides)

A group without tokens (state pages) has its block's first element changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.layout.strided import TOKEN_DIM
from kvxferd.rig.verify.buffers import EngineBuffers

HOW = ("flip", "write")  # one bit of one byte; or every region's element rewritten (an engine's new KV)


@dataclass(frozen=True)
class Damage:
    """What was changed, to put it back: ``(group, region, byte offset, old bytes)`` each."""

    changes: tuple[tuple[int, int, int, bytes], ...]

    def undo(self, engine: EngineBuffers) -> None:
        """The damaged bytes as they were."""
        for g, r, offset, old in self.changes:
            engine.buffers[g][r][offset:offset + len(old)] = np.frombuffer(old, dtype=np.uint8)


def element_offset(engine: EngineBuffers, group: int, block_id: int, token: int = 0) -> tuple[int, int]:
    """``(byte offset in each of the group's region buffers, element bytes)`` of the first element of token
    ``token`` of block ``block_id`` in the group's first field (a field without tokens: the block's first)."""
    layout = engine.cache.region(group).fields[0].layout
    offset = layout.offset
    if TOKEN_DIM in layout.dims:
        for axis in reversed(layout.factors(TOKEN_DIM)):  # (a split token dim: outer to inner factors)
            token, digit = divmod(token, axis.size)
            offset += digit * axis.stride
    return int(layout.block_table_bytes[block_id]) + offset * layout.itemsize, int(layout.itemsize)


def damage_held(engine: EngineBuffers, block_ids: Sequence[Sequence[int]], how: str, rng: np.random.Generator,
                num_tokens: int | None = None) -> Damage:
    """Damage the request's last token in the last block ``block_ids`` names per group (``num_tokens`` its
    tokens; None: the block's first token), in place: ``flip`` one bit of one byte of that element in one
    region of the first group with blocks; ``write`` that element in every region of every group."""
    if how not in HOW:
        raise ValueError(f"damage {how!r}: one of {HOW}")
    changes = []
    for g, ids in enumerate(block_ids):
        if not len(ids):
            continue
        block_size = engine.cache.groups[g].block_size
        token = (num_tokens - 1) % block_size if num_tokens and block_size else 0
        offset, itemsize = element_offset(engine, g, int(ids[-1]), token)
        regions = range(len(engine.buffers[g]))
        if how == "flip":
            regions = [int(rng.integers(len(regions)))]
        for r in regions:
            buf = engine.buffers[g][r]
            old = bytes(buf[offset:offset + itemsize])
            if how == "flip":
                byte = offset + int(rng.integers(itemsize))
                buf[byte] ^= np.uint8(1 << int(rng.integers(8)))
            else:  # never the old value: each byte XORed with a non-zero one
                buf[offset:offset + itemsize] ^= rng.integers(1, 256, itemsize, dtype=np.uint8)
            changes.append((g, r, offset, old))
        if how == "flip":
            break  # one byte of the rank
    return Damage(tuple(changes))
