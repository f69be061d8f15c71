"""Damage a held block in a holder's memory, and undo it: the faults only a hold's digests can catch (issue #59).

Where: the first element of a held block's first field, in each region of a
group. That element is token 0 of the block (a partial last block still
holds it) and this rank's first head, so a reader of the block reads it,
whatever its TP rank, block size or window::

    region (one layer, or L of them)   block b of field 0
    [ ... | e0 e1 e2 ... | ... ]        e0 = token 0, this rank's head 0, channel 0, layer 0 of the region
              ^ block_table_bytes[b] + field offset
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


def element_offset(engine: EngineBuffers, group: int, block_id: int) -> tuple[int, int]:
    """``(byte offset in each of the group's region buffers, element bytes)`` of block ``block_id``'s first
    element of its first field."""
    layout = engine.cache.region(group).fields[0].layout
    return int(layout.block_table_bytes[block_id]) + layout.offset * layout.itemsize, int(layout.itemsize)


def damage_held(engine: EngineBuffers, block_ids: Sequence[Sequence[int]], how: str,
                rng: np.random.Generator) -> Damage:
    """Damage the last block of each group ``block_ids`` names (per group), in place: ``flip`` one bit of one
    byte of one region's first element; ``write`` every region's first element with other bytes."""
    if how not in HOW:
        raise ValueError(f"damage {how!r}: one of {HOW}")
    changes = []
    for g, ids in enumerate(block_ids):
        if not len(ids):
            continue
        offset, itemsize = element_offset(engine, g, int(ids[-1]))
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
