"""Engine ranks with real host buffers, tagged caches and the oracle per request.

A test, the demo or a benchmark allocates every rank of a prefill and a
decode engine here: one numpy buffer per (group, region), prefill buffers
tagged with their coordinates (the region key ``group * 1000 + region``
enters every tag), decode buffers set to the sentinel. After a request, the
decode buffers must equal :func:`expected_buffers`, computed from token
positions alone (no plan, no units, no layouts).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.layout.specs import MambaSpec
from kvxferd.plan.engine import EngineTransferPlan, ReadRequest
from kvxferd.plan.groups import CacheGroup, EngineCache, HostShare, RegionMemory
from kvxferd.rig.verify.oracle import BlockSource, TokenSource, expected_region, first_mismatch, tagged_region
from kvxferd.rig.verify.physical import SENTINEL, region_num_bytes, region_views
from kvxferd.wire.names import SHM_DIR


def region_key(group: int, region: int) -> int:
    return group * 1000 + region


REGION_GAP_BYTES = 4096  # sentinel bytes between regions: stray writes land there


@dataclass(eq=False)
class EngineBuffers:
    """One engine rank: its cache description and the buffers behind it.

    All regions live in one arena, each followed by a sentinel gap, so a
    descriptor address maps to an arena offset and a stray write is seen.
    """

    cache: EngineCache
    arena: np.ndarray  # uint8, every region plus gaps
    buffers: list[list[np.ndarray]]  # [group][region] views into the arena

    @property
    def base_address(self) -> int:
        return self.arena.ctypes.data

    def gaps_intact(self) -> bool:
        """True when no byte outside the regions was written."""
        inside = np.zeros(len(self.arena), dtype=bool)
        for group in self.buffers:
            for buf in group:
                start = buf.ctypes.data - self.base_address
                inside[start : start + buf.nbytes] = True
        return bool(np.all(self.arena[~inside] == SENTINEL))

    @property
    def num_bytes(self) -> int:
        return sum(b.nbytes for group in self.buffers for b in group)

    def reset(self) -> None:
        """Back to the sentinel (decode side, between checks)."""
        for group in self.buffers:
            for buf in group:
                buf[...] = SENTINEL


def arena_layout(groups: Sequence[CacheGroup], tp_size: int, tp_rank: int) -> tuple[list[int], list[int], int]:
    """One engine rank's arena: each group's region size and stride (a region, then a sentinel gap), and the
    arena's bytes (a gap first)."""
    sizes = [region_num_bytes(group.spec, tp_size, tp_rank) for group in groups]
    strides = [-(-size // REGION_GAP_BYTES) * REGION_GAP_BYTES + REGION_GAP_BYTES for size in sizes]
    num_bytes = sum(stride * group.num_regions for stride, group in zip(strides, groups)) + REGION_GAP_BYTES
    return sizes, strides, num_bytes


def allocate_engine(engine_id: str, groups: Sequence[CacheGroup], tp_size: int, tp_rank: int, *, tagged: bool,
                    allocate: Callable[[int], np.ndarray] | None = None) -> EngineBuffers:
    """Allocate (and tag, for a prefill rank) every region of one engine rank.

    ``allocate(num_bytes)`` supplies the arena (default: process memory;
    engines behind a daemon pass shared memory).
    """
    sizes, strides, num_bytes = arena_layout(groups, tp_size, tp_rank)
    arena = np.empty(num_bytes, dtype=np.uint8) if allocate is None else allocate(num_bytes)
    arena[...] = SENTINEL
    buffers, memory, offset = [], [], REGION_GAP_BYTES
    for g, group in enumerate(groups):
        regions = []
        for i in range(group.num_regions):
            buf = arena[offset : offset + sizes[g]]
            offset += strides[g]
            if tagged:
                tagged_region(group.spec, tp_size, tp_rank, region_key(g, i), out=buf)
            regions.append(buf)
        buffers.append(regions)
        memory.append(tuple(RegionMemory(b.ctypes.data, b.nbytes) for b in regions))
    cache = EngineCache(engine_id, tp_size, tp_rank, tuple(groups), tuple(memory))
    return EngineBuffers(cache, arena, buffers)


def shared_engine(engine: EngineBuffers, arena) -> EngineBuffers:
    """``engine`` (allocated in ``arena``, a :class:`~kvxferd.client.shm.SharedArena`) with each region's
    shared-memory object named, as a holder daemon announces it to a same-host reader."""
    status = os.stat(SHM_DIR / arena.name)
    base = arena.array.ctypes.data
    memory = tuple(tuple(dataclasses.replace(r, share=HostShare(arena.name, r.address - base, status.st_dev,
                                                                status.st_ino)) for r in regions)
                   for regions in engine.cache.memory)
    return dataclasses.replace(engine, cache=dataclasses.replace(engine.cache, memory=memory))


def paper_cache(engine_id: str, groups: Sequence[CacheGroup], tp_size: int, tp_rank: int) -> EngineCache:
    """An engine rank at made-up addresses: enough to plan (and check a pairing), nothing allocated."""
    memory, address = [], 1 << 32
    for group in groups:
        size = region_num_bytes(group.spec, tp_size, tp_rank)
        memory.append(tuple(RegionMemory(address + i * (size + REGION_GAP_BYTES), size)
                            for i in range(group.num_regions)))
        address += group.num_regions * (size + REGION_GAP_BYTES)
    return EngineCache(engine_id, tp_size, tp_rank, tuple(groups), tuple(memory))


def check_pairing(prefill_groups: Sequence[CacheGroup], decode_groups: Sequence[CacheGroup], prefill_tp: int,
                  decode_tp: int) -> None:
    """Plan every decode rank against every prefill rank on paper; raises what a daemon would answer."""
    prefill = [paper_cache("p", prefill_groups, prefill_tp, q) for q in range(prefill_tp)]
    for r in range(decode_tp):
        EngineTransferPlan(paper_cache("d", decode_groups, decode_tp, r), prefill)


def group_source(local: CacheGroup, remote: CacheGroup, request: ReadRequest, g: int):
    """Brute-force element source of one group for one request."""
    local_ids, remote_ids = request.local_block_ids[g], request.remote_block_ids[g]
    if isinstance(local.spec, MambaSpec):
        return BlockSource(local_ids, remote_ids, local.spec.num_blocks)
    return TokenSource(local_ids, remote_ids, local.spec.block_size, remote.spec.block_size,
                       request.num_tokens, local.spec.num_blocks)


def expected_buffers(local: EngineCache, remote_groups: Sequence[CacheGroup], request: ReadRequest) -> list[list[np.ndarray]]:
    """What every decode region of ``local`` must hold after ``request`` alone."""
    out = []
    for g, group in enumerate(local.groups):
        source = group_source(group, remote_groups[g], request, g)
        out.append([expected_region(group.spec, local.tp_size, local.tp_rank, source, region_key(g, i))
                    for i in range(group.num_regions)])
    return out


def count_wrong_bytes(engine: EngineBuffers, expected: list[list[np.ndarray]]) -> int:
    """Bytes of the regions that differ from ``expected``."""
    return sum(int(np.count_nonzero(actual != want))
               for actual_group, expected_group in zip(engine.buffers, expected)
               for actual, want in zip(actual_group, expected_group))


def verify_decode(decode: Sequence[EngineBuffers], prefill_groups: Sequence[CacheGroup],
                  request: ReadRequest) -> tuple[list[str], int]:
    """``(mismatch descriptions, wrong byte count)`` over every decode rank for ``request`` alone."""
    problems, wrong = [], 0
    for engine in decode:
        expected = expected_buffers(engine.cache, prefill_groups, request)
        problems += check_buffers(engine, expected)
        wrong += count_wrong_bytes(engine, expected)
    return problems, wrong


def blocks_mask(spec, tp_size: int, tp_rank: int, block_ids) -> np.ndarray:
    """Which bytes of a region belong to logical blocks ``block_ids`` (from the layout's own coordinates)."""
    marks = np.zeros(region_num_bytes(spec, tp_size, tp_rank), dtype=np.uint8)
    ids = np.asarray(block_ids, dtype=np.int64)
    for view in region_views(spec, tp_size, tp_rank, marks):
        inside = np.isin(np.broadcast_to(view.block, view.array.shape), ids)
        view.array[inside] = np.iinfo(view.array.dtype).max  # every byte of the element
    return marks != 0


def check_failed_read(engine: EngineBuffers, prefill_groups: Sequence[CacheGroup], request: ReadRequest,
                      invalid_block_ids: Sequence[Sequence[int]]) -> list[str]:
    """A read that failed on one decode rank: every byte outside the blocks it names invalid must be right.

    The engine recomputes or refetches the named blocks and trusts the rest,
    so a wrong byte in a block the completion did not name is corruption
    served as success.
    """
    expected = expected_buffers(engine.cache, prefill_groups, request)
    cache, problems = engine.cache, []
    for g, (actual_group, expected_group) in enumerate(zip(engine.buffers, expected)):
        named = invalid_block_ids[g] if g < len(invalid_block_ids) else ()
        for i, (actual, want) in enumerate(zip(actual_group, expected_group)):
            wrong = actual != want
            if not wrong.any():
                continue
            unnamed = wrong & ~blocks_mask(cache.groups[g].spec, cache.tp_size, cache.tp_rank, named)
            if unnamed.any():
                problems.append(f"{cache.engine_id} rank {cache.tp_rank} group {g} region {i}: "
                                f"{int(unnamed.sum())} wrong bytes outside the blocks named invalid")
    if not engine.gaps_intact():
        problems.append(f"{cache.engine_id} rank {cache.tp_rank}: bytes written outside every region")
    return problems


def check_buffers(engine: EngineBuffers, expected: list[list[np.ndarray]], *, limit: int = 3) -> list[str]:
    """Readable mismatches (at most ``limit``); empty when byte-exact."""
    problems = []
    cache = engine.cache
    for g, (actual_group, expected_group) in enumerate(zip(engine.buffers, expected)):
        for i, (actual, want) in enumerate(zip(actual_group, expected_group)):
            if len(problems) >= limit or np.array_equal(actual, want):
                continue
            where = first_mismatch(cache.groups[g].spec, cache.tp_size, cache.tp_rank, actual, want)
            problems.append(f"{cache.engine_id} group {g} ({cache.groups[g].kind}) region {i}: {where}")
    if not engine.gaps_intact():
        problems.append(f"{cache.engine_id} rank {cache.tp_rank}: bytes written outside every region")
    return problems


class DecodeChecks:
    """What both test clusters (in-process agents, daemon processes) offer on their decode side.

    Subclasses set ``decode`` (decode :class:`EngineBuffers`), ``prefill_groups``
    and define ``close``.
    """

    decode: list[EngineBuffers]
    prefill_groups: tuple[CacheGroup, ...]

    def verify(self, request: ReadRequest) -> tuple[list[str], int]:
        """``(mismatch descriptions, wrong byte count)`` over every decode rank for ``request`` alone."""
        return verify_decode(self.decode, self.prefill_groups, request)

    def reset_decode(self) -> None:
        for engine in self.decode:
            engine.reset()

    def decode_untouched(self) -> bool:
        """Whether every decode rank's memory still holds the sentinel everywhere since :meth:`reset_decode`
        (a refused read must write nothing)."""
        return all(engine.gaps_intact() and all(np.all(buf == SENTINEL) for group in engine.buffers for buf in group)
                   for engine in self.decode)

    def close(self) -> None:
        raise NotImplementedError

    def check(self, request: ReadRequest) -> list[str]:
        """Mismatches of every decode rank against the oracle for ``request`` alone."""
        return self.verify(request)[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
