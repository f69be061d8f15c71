"""A same-host holder's host memory, mapped read-only by the reader, and its reads copied in the kernel.

Issue #37. When the reader proved it shares the holder's host and the
holder proved it back (kvxferd.wire.samehost), the holder names the POSIX
shared-memory object each region lies in: by its name under /dev/shm, or,
when the engine passed it as an fd, as ``/proc/<holder pid>/fd/<its copy>``.
The reader maps each object once, read-only, and a rank's data READ becomes
one :func:`~kvxferd.xfer.samehost.hostcopy.copy_spans` from its mapping into the
reader's own registered cache::

    holder's address space      reader's address space
    region r at A_r  ─ object, offset o_r ─►  object mapped at M (read-only)
    remote descriptor at a      ──────────► a - A_r + M + o_r   (checked: inside region r)

Everything else of a read stays as over NIXL: the board checks before and
after the copy (loads from the holder's board, mapped too when the holder
named it: kvxferd.xfer.samehost.boards; else NIXL READs of it), the notices,
the deadline. Nothing the holder sent can make the reader read outside the
objects it mapped: every source span must lie inside one announced region,
and every region inside its object.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import TransferError
from kvxferd.plan.descriptors import RowIndex, expand_rows
from kvxferd.plan.engine import RankPlan, RankRead
from kvxferd.plan.groups import EngineCache, HostShare, RegionMemory
from kvxferd.xfer.samehost.hostcopy import available as hostcopy_available, copy_spans
from kvxferd.xfer.samehost.opened import TMPFS, OpenedObjects, fs_type, open_passed

SHM_DIR = "/dev/shm"
MAX_ADDRESS = 1 << 57  # above any user-space address (5-level paging): int64 arithmetic cannot wrap


@dataclass(eq=False)
class MappedSource:
    """One remote rank's regions as opened here: where each region's bytes are (sorted by remote address).
    Host memory (:func:`map_host_source`) or GPU memory (:mod:`kvxferd.xfer.samehost.devicemaps`)."""

    starts: np.ndarray  # remote region start addresses, ascending (the holder's address space)
    ends: np.ndarray
    shifts: np.ndarray  # local address - remote address, per region
    closers: list[Callable[[], object]] = field(default_factory=list, repr=False)  # run in order by close()
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
        so no host copy runs meanwhile (one that did would fail with EFAULT, not crash); a device source's
        first closer waits for the copies already on the stream."""
        self.closed = True
        for closer in self.closers:
            closer()
        self.closers.clear()

    def place(self, placed: list[tuple[RegionMemory, int, int]]) -> None:
        """Take each region's local start address and the bytes its object has from there on: checked that
        the region fits, is an address range, and overlaps no other; raises :class:`TransferError`."""
        starts, ends, shifts = [], [], []
        for region, local_start, room in placed:
            if region.num_bytes > room:
                raise TransferError("same_host", f"region of {region.num_bytes} bytes exceeds the memory the holder "
                                                 f"named for it ({room} bytes from its offset)")
            if not 0 < region.address < region.address + region.num_bytes <= MAX_ADDRESS:
                raise TransferError("same_host", f"region at {region.address:#x} of {region.num_bytes} bytes is not "
                                                 "an address range")
            starts.append(region.address)
            ends.append(region.address + region.num_bytes)
            shifts.append(local_start - region.address)
        order = np.argsort(starts)
        self.starts, self.ends = np.asarray(starts, np.int64)[order], np.asarray(ends, np.int64)[order]
        self.shifts = np.asarray(shifts, np.int64)[order]
        if len(order) > 1 and (self.starts[1:] < self.ends[:-1]).any():
            raise TransferError("same_host", "the holder's regions overlap")


def empty_source() -> MappedSource:
    return MappedSource(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def map_host_source(cache: EngineCache, shm_dir: str = SHM_DIR, opened: OpenedObjects | None = None, *,
                    writable: bool = False) -> MappedSource:
    """Map every region's shared-memory object of a remote rank read-only (``writable``: read-write, for a
    push's copies into it). Raises :class:`TransferError` when a region has no object, an object is gone or is
    another one now, or a region does not lie inside it.

    ``opened``: the objects engines passed by fd, already opened by another process for this one
    (:func:`~kvxferd.xfer.samehost.opened.open_passed_objects`; a sandboxed reader worker cannot reach
    ``/proc/<holder>/fd``); they are checked here as if opened here, and the caller keeps and closes them."""
    regions = [region for memory in cache.memory for region in memory]
    if cache.mem_type != "DRAM" or not regions or any(not isinstance(r.share, HostShare) for r in regions):
        raise TransferError("same_host", "not every region is host memory in a shared-memory object it names")
    if not hostcopy_available():
        raise TransferError("same_host", "process_vm_readv is refused in this daemon (seccomp?)")
    mapped: dict[tuple[int, int], tuple[int, int]] = {}  # object identity -> (base here, size)
    source = empty_source()
    try:
        for share in {r.share for r in regions}:
            identity = (share.device, share.inode)
            if identity not in mapped:
                mapped[identity] = map_object(share, shm_dir, source.closers, opened, writable=writable)
        placed = []
        for region in regions:
            base, size = mapped[(region.share.device, region.share.inode)]
            placed.append((region, base + region.share.offset, size - region.share.offset))
        source.place(placed)
    except BaseException:
        source.close()
        raise
    return source


def map_object(share: HostShare, shm_dir: str, closers: list, opened: OpenedObjects | None, *,
               sealed: bool = False, writable: bool = False) -> tuple[int, int]:
    """Map one object read-only, or read-write when ``writable`` (its unmapping appended to ``closers``); its base
    address here and its size.

    A name is opened under ``shm_dir`` and never through a symlink. An object the engine passed as an fd
    is opened through the holder's copy of it, ``/proc/<pid>/fd/<fd>``: a link the kernel follows to the
    open file itself (the same user and PID namespace only), checked below like a name; or, when another
    process opened it for this one, a duplicate of the fd in ``opened``. ``sealed``: only an object that
    can no longer shrink (a memfd sealed so): what is read with plain loads, not in the kernel, must not
    lose its pages under the reader (SIGBUS)."""
    identity, name = (share.device, share.inode), share.name or share.path
    if share.name:
        bare = name[1:] if name.startswith("/") else name
        if not bare or "/" in bare:  # validated when decoded: never a path out of the directory
            raise TransferError("same_host", f"not a shared-memory object name: {name[:64]!r}")
        try:
            fd = os.open(os.path.join(shm_dir, bare), (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC |
                         os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as err:  # another IPC namespace, no permission, gone
            raise TransferError("same_host", f"cannot open shared-memory object {name!r}: {err.strerror}") from None
    else:
        fd = opened.object_fd(identity, name) if opened is not None and not writable else None
        if fd is None:
            fd = open_passed(share, writable=writable)
    try:
        # Sealed first, sized after: once it cannot shrink, the size read is one it keeps. (tmpfs only: a
        # hole punched in hugetlbfs pages can still fault a load when the pool is empty.)
        if sealed and (fs_type(fd) != TMPFS or not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK):
            raise TransferError("same_host", f"shared-memory object {name!r} is not a memfd sealed against shrinking")
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or (status.st_dev, status.st_ino) != identity:
            raise TransferError("same_host", f"shared-memory object {name!r} is not the one the holder mapped")
        if not status.st_size:
            raise TransferError("same_host", f"shared-memory object {name!r} is empty")
        mapping = mmap.mmap(fd, status.st_size, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ)
    except OSError as err:
        raise TransferError("same_host", f"cannot map shared-memory object {name!r}: {err.strerror}") from None
    finally:
        os.close(fd)
    closers.append(mapping.close)
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

    source: MappedSource
    local: RowIndex
    remote: RowIndex
    # Expanded tables, or None: local addresses and lengths, remote addresses translated here, and lengths.
    tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    # (destinations, sources, lengths) -> bytes copied (host memory: copied when it returns) or a pending
    # device copy the executor polls (GPU memory: kvxferd.xfer.samehost.devicemaps).
    copier: Callable[[np.ndarray, np.ndarray, np.ndarray], object] = copy_spans
    on_device: bool = False  # GPU memory, copied by batches on the device
    writes: bool = False  # a push's: copies go from this process's cache into the mapped memory
    board: object = None  # the holder's board mapped here (kvxferd.xfer.samehost.boards), or None: NIXL checks

    @classmethod
    def of(cls, source: MappedSource, rank_plan: RankPlan, copier=copy_spans, *, on_device: bool = False,
           writes: bool = False) -> "HostRank":
        """``rank_plan``'s local rows are this process's cache, its remote rows the mapped memory's (for a push:
        the writer's rows local, the target's remote); ``writes``: copy local -> mapped, not mapped -> local."""
        rank = cls(source, RowIndex.of(rank_plan.local_rows), RowIndex.of(rank_plan.remote_rows), copier=copier,
                   on_device=on_device, writes=writes)
        if max(rank.local.num_descriptors, rank.remote.num_descriptors) <= EXPAND_MAX_DESCRIPTORS:
            local_addresses, local_lengths = expand_rows(rank_plan.local_rows)
            remote_addresses, remote_lengths = expand_rows(rank_plan.remote_rows)
            rank.tables = (local_addresses, local_lengths, source.translate(remote_addresses, remote_lengths),
                           remote_lengths)
        return rank

    def copy(self, read: RankRead) -> object:
        """Copy one rank's part of a read (a push's write, with ``writes``): what the copier returns. Raises
        :class:`TransferError` (nothing or a prefix copied: the caller fails the rank, whose blocks are then
        invalid)."""
        self.source.check_open()
        if self.tables is not None:
            local_addresses, local_lengths, mapped_addresses, remote_lengths = self.tables
            lengths, remote_lengths = local_lengths[read.local_ids], remote_lengths[read.remote_ids]
            local, mapped = local_addresses[read.local_ids], mapped_addresses[read.remote_ids]
        else:
            local, lengths = self.local.spans(read.local_ids)
            remote_addresses, remote_lengths = self.remote.spans(read.remote_ids)
            mapped = self.source.translate(remote_addresses, lengths)
        if not np.array_equal(lengths, remote_lengths):
            raise TransferError("same_host", "local and remote spans differ in length")
        return self.copier(mapped, local, lengths) if self.writes else self.copier(local, mapped, lengths)
