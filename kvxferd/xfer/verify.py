"""Check what a read wrote against its holders' digests before the engine hears it ended (issue #59).

::

    every rank's data in, every board check passed (the result would be ok)
      └─► per remote rank with digests: digest the local blocks its part wrote (kvxferd.plan.holddigests)
            equal    ok, as before
            differ   the read fails (CORRUPT); the blocks holding a differing atom are invalid, the engine
                     recomputes them

Host memory only: the local cache's regions are read where this process
mapped them. A read with digests into a GPU cache is refused when posted
(ReadExecutor.post), as reader workers refuse them: never read unchecked.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import UnavailableError
from kvxferd.plan.engine import PlannedRead
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.holddigests import LocalDigests, check_read


@dataclass
class DigestCounts:
    """What the checks of one executor found, for the metrics."""

    num_reads_checked: int = 0
    num_reads_corrupt: int = 0
    num_atoms_checked: int = 0
    num_units_unverifiable: int = 0  # units read whose atoms do not line up with the holder's
    num_bytes_checked: int = 0


def host_memories(cache: EngineCache) -> list[list[np.ndarray]] | None:
    """The cache's regions as uint8 arrays over this process's mapping of them; None when they are not host
    memory of this process (a GPU cache)."""
    if cache.mem_type != "DRAM":
        return None
    return [[np.ctypeslib.as_array((ctypes.c_uint8 * mem.num_bytes).from_address(mem.address)) for mem in regions]
            for regions in cache.memory]


def corrupt_blocks(planned: PlannedRead, cache: EngineCache, memories, counts: DigestCounts
                   ) -> tuple[dict[int, str], tuple[np.ndarray, ...]] | None:
    """Compare a read's blocks with its holders' digests: None when they agree (or it carries none); else
    (an error per remote rank that differed, the local block ids per group that hold a differing atom)."""
    digests = planned.request.remote_digests
    if not digests:
        return None
    if memories is None:  # (refused when posted: not reached)
        raise UnavailableError("remote_digests", "no digest checks of this cache's memory")
    errors, bad = {}, [np.zeros(0, np.int64) for _ in planned.units]
    rank_plans = {rp.remote_rank: rp for rp in planned.plan.rank_plans}
    local = LocalDigests(cache, memories)  # each group's local digests made once, for every holder rank
    for read in planned.reads:
        q = read.remote_rank
        result = check_read(local, planned.plan.remotes[q], planned.units, planned.plan.pairings,
                            rank_plans[q].groups, digests[q])
        counts.num_atoms_checked += result.num_atoms_checked
        counts.num_units_unverifiable += result.num_units_unverifiable
        blocks = sum(len(ids) for ids in result.bad_block_ids)
        if result.malformed:
            errors[q] = f"its digests do not describe its cache ({result.malformed}): {blocks} blocks not trusted"
        elif blocks:
            errors[q] = f"{blocks} blocks differ from the holder's digests of its hold"
        bad = [np.union1d(a, b) for a, b in zip(bad, result.bad_block_ids)]
    counts.num_reads_checked += 1
    counts.num_bytes_checked += planned.num_bytes
    if not errors:
        return None
    counts.num_reads_corrupt += 1
    return errors, tuple(bad)
