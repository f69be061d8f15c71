"""Cache groups of an engine, and which block ids of a request pair up.

An engine's cache is a list of groups, each of one kind (full attention,
sliding window, MLA, Mamba / linear attention) with its own block size and
its own block ids per request. Each group stores ``num_regions`` regions of
the same layout (one per layer, or one holding every layer).

Pairing block ids is done in *units* of the smaller logical block size of
the two sides, on absolute token positions. Both sides list blocks that end
at the request's last token; a side with ``n`` blocks of ``k`` units each
covers units ``[(E - n) * k, E * k)`` where ``E = ceil(num_tokens / block)``::

    num_tokens = 40, prefill blocks of 32, decode blocks of 16 (units of 16)
    prefill ids [7, 9]        units  0 1 | 2 3      (block 7 = units 0,1)
    decode  ids [4, 5]        (1 block cached)  units 1 | 2
    pairs   decode unit (4,1)<-prefill (7,1), (5,0)<-(9,0); unit 3 is past the end

The policy of a group kind decides what a mismatch means: ``prefix`` (full
attention, MLA) reads only the units the local side lists and refuses local
blocks the remote side never had; ``window`` (sliding window) reads the units
both list; ``exact`` (Mamba) pairs whole state pages one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError
from kvxferd.layout.region import Region
from kvxferd.layout.specs import AttentionSpec, CacheSpec, MambaSpec
from kvxferd.layout.spans import check_block_ids
from kvxferd.layout.strided import positive_int
from kvxferd.tp.shards import check_tp

GROUP_POLICIES = {"full": "prefix", "mla": "prefix", "swa": "window", "mamba": "exact", "linear": "exact"}
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class CacheGroup:
    """One cache group: a kind, a per-region spec and how many regions."""

    kind: str
    spec: CacheSpec
    num_regions: int = 1

    def __post_init__(self) -> None:
        if self.kind not in GROUP_POLICIES:
            raise InvalidArgumentError("kind", f"must be one of {sorted(GROUP_POLICIES)}, got {self.kind!r}")
        positive_int(self.num_regions, "num_regions")
        stateful = self.kind in ("mamba", "linear")
        if stateful != isinstance(self.spec, MambaSpec):
            raise InvalidArgumentError("spec", f"a {self.kind!r} group needs a {'Mamba' if stateful else 'attention'} spec")
        if isinstance(self.spec, AttentionSpec) and (self.kind == "mla") != self.spec.is_latent:
            raise InvalidArgumentError("spec.layout", f"a {self.kind!r} group cannot use layout {self.spec.layout!r}")

    @property
    def policy(self) -> str:
        return GROUP_POLICIES[self.kind]

    @property
    def block_size(self) -> int | None:
        """Tokens per logical block; None for state pages (one per request)."""
        return self.spec.block_size if isinstance(self.spec, AttentionSpec) else None


@dataclass(frozen=True)
class HostShare:
    """The shared-memory object a host-memory region lies in, for a reader on the same host to map it
    itself (issue #37): the region's offset in it and the object's identity (``st_dev``, ``st_ino``) as
    the holder opened it, so a name reused for another object is not mistaken for it. Named by its name
    under /dev/shm, or, when the engine passed it as an fd, by the holder's open copy of that fd
    (``/proc/<holder_pid>/fd/<holder_fd>``; ``name`` is then "")."""

    name: str
    offset: int
    device: int
    inode: int
    holder_pid: int = 0
    holder_fd: int = -1

    @property
    def path(self) -> str:
        """Where a reader on this host opens it: ``/proc/<pid>/fd/<fd>`` or the name (relative to /dev/shm)."""
        return self.name or f"/proc/{self.holder_pid}/fd/{self.holder_fd}"


@dataclass(frozen=True)
class DeviceShare:
    """The CUDA IPC handle of the GPU allocation a region lies in, for a reader on the same host to open it
    itself (issue #37): the bare 64-byte handle, the region's offset in the allocation, and the GPU's
    UUID (the reader may see it under another index). Whoever opens the handle can reach the whole
    allocation, not only the region: it is given only to authenticated same-host readers."""

    ipc_handle: bytes
    offset: int
    device_uuid: str

    def __repr__(self) -> str:  # never the handle in a log line
        return f"DeviceShare(offset={self.offset}, device_uuid={self.device_uuid!r})"


@dataclass(frozen=True)
class VmmShare:
    """A GPU VMM allocation a region lies in, for a reader on the same host (issue #56): the holder serves
    the allocation's fd on its fd socket to whoever presents ``token`` (given only to authenticated
    same-host readers), reached as ``/proc/<holder_pid>/root<socket_path>``. Like a CUDA IPC handle, the fd
    opens the whole allocation (``allocation_bytes``); the region starts ``offset`` bytes in."""

    token: str
    socket_path: str
    holder_pid: int
    offset: int
    allocation_bytes: int
    device_uuid: str

    def __repr__(self) -> str:  # never the token in a log line
        return f"VmmShare(pid={self.holder_pid}, offset={self.offset}, device_uuid={self.device_uuid!r})"


@dataclass(frozen=True)
class RegionMemory:
    """Where one registered region lives."""

    address: int
    num_bytes: int
    device_id: int = 0
    share: HostShare | DeviceShare | VmmShare | None = None  # what a same-host reader may open itself


@dataclass(frozen=True, eq=False)
class EngineCache:
    """What one TP rank of an engine registers: its groups and their memory."""

    engine_id: str
    tp_size: int
    tp_rank: int
    groups: tuple[CacheGroup, ...]
    memory: tuple[tuple[RegionMemory, ...], ...]  # [group][region]
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise InvalidArgumentError("engine_id", "must not be empty")
        check_tp(self.tp_size, self.tp_rank, field="tp")
        if not self.groups:
            raise InvalidArgumentError("groups", "an engine needs at least one cache group")
        if self.mem_type not in MEM_TYPES:
            raise InvalidArgumentError("mem_type", f"must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if len(self.memory) != len(self.groups):
            raise InvalidArgumentError("memory", f"{len(self.memory)} memory lists for {len(self.groups)} groups")
        for g, (group, regions) in enumerate(zip(self.groups, self.memory)):
            if len(regions) != group.num_regions:
                raise InvalidArgumentError(f"memory[{g}]", f"{len(regions)} regions, group declares {group.num_regions}")
            need = self.region(g).num_bytes
            for i, mem in enumerate(regions):
                if mem.num_bytes < need:
                    raise InvalidArgumentError(f"memory[{g}][{i}].num_bytes", f"{mem.num_bytes} bytes, layout needs {need}")

    def region(self, group: int) -> Region:
        """The layout of every region of ``group`` on this rank."""
        return self.groups[group].spec.region(self.tp_size, self.tp_rank)

    @cached_property
    def layer_counts(self) -> tuple[int, ...]:
        """Per group, its layers: one per region, times the layers stored inside one (``L``)."""
        return tuple(group.num_regions * self.region(g).num_layers for g, group in enumerate(self.groups))


def check_groups_compatible(local: EngineCache, remote: EngineCache) -> None:
    """Refuse engine pairs whose groups cannot be paired one to one."""
    if len(local.groups) != len(remote.groups):
        raise LayoutMismatchError("groups", f"local engine has {len(local.groups)} cache groups, remote has {len(remote.groups)}")
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups)):
        if lg.kind != rg.kind:
            raise LayoutMismatchError(f"groups[{g}].kind", f"local {lg.kind!r} vs remote {rg.kind!r}")
        if lg.num_regions != rg.num_regions:
            raise LayoutMismatchError(f"groups[{g}].num_regions", f"local {lg.num_regions} vs remote {rg.num_regions}")
        if lg.block_size is not None:
            small, large = sorted((lg.block_size, rg.block_size))
            if large % small:
                raise LayoutMismatchError(f"groups[{g}].block_size", f"local {lg.block_size} and remote {rg.block_size}: neither divides the other")


@dataclass(frozen=True)
class GroupPairing:
    """Block-id arithmetic of one group pair, fixed at plan time."""

    policy: str
    local_block_size: int | None
    remote_block_size: int | None
    num_local_blocks: int
    num_remote_blocks: int

    @property
    def unit_tokens(self) -> int | None:
        if self.local_block_size is None:
            return None
        return min(self.local_block_size, self.remote_block_size)

    @property
    def local_units_per_block(self) -> int:
        return 1 if self.local_block_size is None else self.local_block_size // self.unit_tokens

    @property
    def remote_units_per_block(self) -> int:
        return 1 if self.remote_block_size is None else self.remote_block_size // self.unit_tokens

    def pair_units(self, local_block_ids, remote_block_ids, num_tokens: int | None, field: str, *,
                   restores_nothing: bool = False):
        """``(local_units, remote_units)``: unit ids to read, pairwise.

        ``restores_nothing``: the read lists no local block in any group (it only
        ends the remote hold), so a state group may list none either.
        """
        local_ids = check_block_ids(local_block_ids, self.num_local_blocks, f"{field}.local_block_ids")
        remote_ids = check_block_ids(remote_block_ids, self.num_remote_blocks, f"{field}.remote_block_ids")
        # Two remote blocks read into one local block would leave it holding
        # whichever landed last: refuse, naming the repeated id.
        check_unique_ids(local_ids, f"{field}.local_block_ids")
        n_local, n_remote = len(local_ids), len(remote_ids)
        if self.policy == "exact":
            if n_local == 0 and restores_nothing:  # a release-only read (it still ends the remote hold)
                empty = np.zeros(0, dtype=np.int64)
                return empty, empty
            if n_local != n_remote:
                raise InvalidArgumentError(field, f"state pages pair one to one: {n_local} local vs {n_remote} remote ids")
            return local_ids, remote_ids
        k_local, k_remote, unit = self.local_units_per_block, self.remote_units_per_block, self.unit_tokens
        if num_tokens is None:
            if k_local != k_remote:
                raise InvalidArgumentError(
                    "num_tokens", f"required when block sizes differ ({field}: local {self.local_block_size}, "
                    f"remote {self.remote_block_size})")
            num_tokens = max(n_local, n_remote) * self.local_block_size
        num_tokens = positive_int(num_tokens, "num_tokens") if n_local or n_remote else 0
        end_units = -(-num_tokens // unit)
        local_end = -(-num_tokens // self.local_block_size)
        remote_end = -(-num_tokens // self.remote_block_size)
        for side, n, end in (("local", n_local, local_end), ("remote", n_remote, remote_end)):
            if n > end:
                raise InvalidArgumentError(f"{field}.{side}_block_ids", f"{n} blocks for {num_tokens} tokens (at most {end})")
        local_start, remote_start = (local_end - n_local) * k_local, (remote_end - n_remote) * k_remote
        if self.policy == "prefix" and n_local and local_start < remote_start:
            raise InvalidArgumentError(
                field, f"{n_local} local blocks reach before the {n_remote} remote blocks (not a prefix-cache hit)")
        first, stop = max(local_start, remote_start), end_units
        if stop <= first:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        local_units = _units(local_ids, k_local)[first - local_start : stop - local_start]
        remote_units = _units(remote_ids, k_remote)[first - remote_start : stop - remote_start]
        return local_units, remote_units


def check_unique_ids(block_ids: np.ndarray, field: str) -> None:
    """Refuse a destination block listed twice (vectorised: one sort)."""
    if len(block_ids) < 2:
        return
    ordered = np.sort(block_ids)
    same = ordered[1:] == ordered[:-1]
    if same.any():  # only a refused request pays for naming the repeat
        repeats = np.flatnonzero(same)
        block_id = int(ordered[repeats[0]])
        first = int(np.flatnonzero(block_ids == block_id)[1])
        raise InvalidArgumentError(f"{field}[{first}]", f"block id {block_id} is listed more than once "
                                                        f"({repeats.size} repeats): each local block can receive one block")


def _units(block_ids: np.ndarray, k: int) -> np.ndarray:
    """Unit ids of logical blocks: block ``b`` is units ``b*k .. b*k+k-1``."""
    if k == 1:
        return block_ids
    return (block_ids[:, None] * k + np.arange(k, dtype=np.int64)[None, :]).ravel()
