"""A same-host holder's host memory, mapped read-only by the reader, and its reads copied in the kernel.

Issue #37. When the holder proved nothing and the reader proved it shares
the holder's host (kvxferd.wire.samehost), the holder names the POSIX
shared-memory object each region lies in. The reader maps each object once,
read-only, and a rank's data READ becomes one :func:`~kvxferd.xfer.hostcopy.copy_spans`
from its mapping into the reader's own registered cache::

    holder's address space      reader's address space
    region r at A_r  ─ name, offset o_r ─►  object mapped at M (read-only)
    remote descriptor at a      ──────────► a - A_r + M + o_r   (checked: inside region r)

Everything else of a read stays as over NIXL: the board checks before and
after the copy (still NIXL READs of the holder's board), the notices, the
deadline. Nothing the holder sent can make the reader read outside the
objects it mapped: every source span must lie inside one announced region,
and every region inside its object.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import TransferError
from kvxferd.plan.descriptors import RowIndex, expand_rows
from kvxferd.plan.engine import RankPlan, RankRead
from kvxferd.plan.groups import EngineCache
from kvxferd.xfer.hostcopy import copy_spans

SHM_DIR = "/dev/shm"
MAX_ADDRESS = 1 << 57  # above any user-space address (5-level paging): int64 arithmetic cannot wrap


@dataclass(eq=False)
class HostSource:
    """One remote rank's regions as mapped here: where each region's bytes are (sorted by remote address)."""

    starts: np.ndarray  # remote region start addresses, ascending (the holder's address space)
    ends: np.ndarray
    shifts: np.ndarray  # local address - remote address, per region
    _mappings: list[mmap.mmap] = field(default_factory=list, repr=False)
    closed: bool = False

    def translate(self, addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Local addresses of remote spans; raises :class:`TransferError` for a span outside every region."""
        self.check_open()
        region = np.searchsorted(self.starts, addresses, side="right") - 1
        outside = (region < 0) | (addresses + lengths > self.ends[np.maximum(region, 0)])
        if outside.any():
            raise TransferError("remote_block_ids", f"{int(outside.sum())} spans lie outside the holder's regions")
        return addresses + self.shifts[region]

    def check_open(self) -> None:
        """Raises :class:`TransferError` once closed: its addresses may be another mapping's by now."""
        if self.closed:
            raise TransferError("same_host", "the holder's memory was unmapped (its connection was released)")

    def close(self) -> None:
        """Unmap; every later copy from it is refused (:meth:`check_open`). Callers hold the executor's lock,
        so no copy runs meanwhile (one that did would fail with EFAULT, not crash)."""
        self.closed = True
        for mapping in self._mappings:
            mapping.close()
        self._mappings.clear()


def map_host_source(cache: EngineCache, shm_dir: str = SHM_DIR) -> HostSource:
    """Map every region's shared-memory object of a remote rank read-only. Raises :class:`TransferError` when
    a region has no object, an object is gone or is another one now, or a region does not lie inside it."""
    regions = [region for memory in cache.memory for region in memory]
    if cache.mem_type != "DRAM" or not regions or any(r.share is None for r in regions):
        raise TransferError("same_host", "not every region is host memory in a named shared-memory object")
    mapped: dict[tuple[int, int], tuple[int, int]] = {}  # object identity -> (base here, size)
    source = HostSource(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    try:
        for share in {r.share for r in regions}:
            identity = (share.device, share.inode)
            if identity not in mapped:
                mapped[identity] = _map(share.name, identity, shm_dir, source._mappings)
        starts, ends, shifts = [], [], []
        for region in regions:
            share = region.share
            base, size = mapped[(share.device, share.inode)]
            if share.offset + region.num_bytes > size:
                raise TransferError("same_host", f"region of {region.num_bytes} bytes at offset {share.offset} "
                                                 f"exceeds shared-memory object {share.name!r} ({size} bytes)")
            if not 0 < region.address < region.address + region.num_bytes <= MAX_ADDRESS:
                raise TransferError("same_host", f"region at {region.address:#x} of {region.num_bytes} bytes is not "
                                                 "an address range")
            starts.append(region.address)
            ends.append(region.address + region.num_bytes)
            shifts.append(base + share.offset - region.address)
        order = np.argsort(starts)
        source.starts, source.ends = np.asarray(starts, np.int64)[order], np.asarray(ends, np.int64)[order]
        source.shifts = np.asarray(shifts, np.int64)[order]
        if len(order) > 1 and (source.starts[1:] < source.ends[:-1]).any():
            raise TransferError("same_host", "the holder's regions overlap")
    except BaseException:
        source.close()
        raise
    return source


def _map(name: str, identity: tuple[int, int], shm_dir: str, mappings: list[mmap.mmap]) -> tuple[int, int]:
    """Map one object read-only (appended to ``mappings``); its base address here and its size."""
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare:  # validated when decoded: never a path out of the directory
        raise TransferError("same_host", f"not a shared-memory object name: {name[:64]!r}")
    try:
        fd = os.open(os.path.join(shm_dir, bare), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:  # another IPC namespace, no permission, gone
        raise TransferError("same_host", f"cannot open shared-memory object {name!r}: {err.strerror}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or (status.st_dev, status.st_ino) != identity:
            raise TransferError("same_host", f"shared-memory object {name!r} is not the one the holder mapped")
        if not status.st_size:
            raise TransferError("same_host", f"shared-memory object {name!r} is empty")
        mapping = mmap.mmap(fd, status.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as err:
        raise TransferError("same_host", f"cannot map shared-memory object {name!r}: {err.strerror}") from None
    finally:
        os.close(fd)
    mappings.append(mapping)
    view = np.frombuffer(mapping, np.uint8)
    base = view.ctypes.data
    del view  # no export may outlive the mapping (close would refuse)
    return base, status.st_size


# Up to this many descriptors a side, a rank's address tables are expanded once at connect (16 bytes each,
# 32 MiB a side at most) and a read's spans are two lookups; above it, looked up per read (RowIndex).
EXPAND_MAX_DESCRIPTORS = 1 << 21


@dataclass(eq=False)
class HostRank:
    """How one remote rank's reads are copied here: its mapped memory and both sides' descriptor tables.

    A small plan's tables are expanded at connect, the remote side already translated into this
    process (and checked: every descriptor the holder's plan names lies inside its regions), so a read
    costs two lookups and the copy; a large plan's are looked up per read (``searchsorted`` over rows)."""

    source: HostSource
    local: RowIndex
    remote: RowIndex
    # Expanded tables, or None: local addresses and lengths, remote addresses translated here, and lengths.
    tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def of(cls, source: HostSource, rank_plan: RankPlan) -> "HostRank":
        rank = cls(source, RowIndex.of(rank_plan.local_rows), RowIndex.of(rank_plan.remote_rows))
        if max(rank.local.num_descriptors, rank.remote.num_descriptors) <= EXPAND_MAX_DESCRIPTORS:
            local_addresses, local_lengths = expand_rows(rank_plan.local_rows)
            remote_addresses, remote_lengths = expand_rows(rank_plan.remote_rows)
            rank.tables = (local_addresses, local_lengths, source.translate(remote_addresses, remote_lengths),
                           remote_lengths)
        return rank

    def copy(self, read: RankRead) -> int:
        """Copy one rank's part of a read; its bytes. Raises :class:`TransferError` (nothing or a prefix
        copied: the caller fails the rank, whose blocks are then invalid)."""
        self.source.check_open()
        if self.tables is not None:
            local_addresses, local_lengths, sources, remote_lengths = self.tables
            lengths, source_addresses = local_lengths[read.local_ids], sources[read.remote_ids]
            remote_lengths = remote_lengths[read.remote_ids]
            destinations = local_addresses[read.local_ids]
        else:
            destinations, lengths = self.local.spans(read.local_ids)
            remote_addresses, remote_lengths = self.remote.spans(read.remote_ids)
            source_addresses = self.source.translate(remote_addresses, lengths)
        if not np.array_equal(lengths, remote_lengths):
            raise TransferError("same_host", "local and remote spans differ in length")
        return copy_spans(destinations, source_addresses, lengths)
