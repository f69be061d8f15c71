"""Protocol messages <-> the plan layer's types, validated on the way in.

Everything that arrives over gRPC passes through here before the daemon
uses it: specs are rebuilt with the same validation as local code (sizes,
dtypes, layouts), ids become integer arrays, and every problem raises a
typed error naming the message field (``groups[1].attention.head_size``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from kvxferd.errors import InvalidArgumentError, KvxferError
from kvxferd.layout.specs import ATTENTION_LAYOUTS, AttentionSpec, CacheSpec, CacheStrides, MambaSpec
from kvxferd.layout.strided import ITEMSIZES
from kvxferd.plan.capability import check_capability_bytes
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup, DeviceShare, EngineCache, HostShare, RegionMemory, VmmShare
from kvxferd.plan.holddigests import HoldDigests
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.names import shm_path

MAX_ID_LENGTH = 256
IPC_HANDLE_BYTES = 64  # a bare cudaIpcMemHandle_t
MAX_PID = 1 << 22  # Linux's pid_max limit
MAX_FD = 1 << 30
SHARE_TOKEN = re.compile(r"[0-9a-f]{32}")  # a VmmShare's token: 128 random bits in hex
SHARE_SOCKET_MAX_BYTES = 1024  # a VmmShare's socket path (reached through its directory: vmmshare.py)
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # nvidia-smi's form


def check_id(value: str, field: str) -> str:
    """Engine and request ids: non-empty, printable, bounded."""
    if not value or len(value) > MAX_ID_LENGTH or not value.isprintable():
        raise InvalidArgumentError(field, f"must be 1..{MAX_ID_LENGTH} printable characters, got {value[:40]!r}")
    return value


MAX_TP_SIZE = 1024  # remote TP ranks one handshake may name


def check_peer_addresses(addresses: Sequence[str]) -> tuple[str, ...]:
    """One ``host:port`` per remote TP rank: 1..MAX_TP_SIZE distinct addresses.

    Each address serves one rank of an engine, so a repeated address can
    never be right (and would make two ranks' handshakes share a channel).
    """
    if not 0 < len(addresses) <= MAX_TP_SIZE:
        raise InvalidArgumentError("peer_addresses", f"give one peer address per remote TP rank (1..{MAX_TP_SIZE}), "
                                                     f"got {len(addresses)}")
    first_at: dict[str, int] = {}
    for q, address in enumerate(addresses):
        check_id(address, f"peer_addresses[{q}]")
        _check_host_port(address, f"peer_addresses[{q}]")
        if address in first_at:
            raise InvalidArgumentError(f"peer_addresses[{q}]", f"{address!r} is listed already as "
                                                               f"peer_addresses[{first_at[address]}]")
        first_at[address] = q
    return tuple(addresses)


def _check_host_port(address: str, field: str) -> None:
    """``host:port`` or ``[v6]:port`` with a port in 1..65535: peers are dialled over TCP, nothing else."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(field, f"{address!r} is not host:port with a port in 1..65535")


def check_seconds(value: float, field: str, *, default_s: float, max_s: float) -> float:
    """A duration from outside (lease, deadline): 0 means ``default_s``; finite, positive, at most ``max_s``
    (the daemon's option ``max_<field>``).

    Over the limit is INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: the limit is
    fixed for the daemon's life, so the same request never succeeds later,
    and engines back off and retry on RESOURCE_EXHAUSTED.

    NaN compares false with everything and inf never runs out: either would
    pin blocks or keep a read waiting forever, so both are refused by name.
    """
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(field, f"must be a finite number of seconds >= 0 (0: the default), got {value}")
    if value > max_s:
        raise InvalidArgumentError(field, f"{value:g} s is over this daemon's max_{field} ({max_s:g} s)")
    return value or default_s


def _spec_from_pb(group: pb.CacheGroup, field: str) -> CacheSpec:
    which = group.WhichOneof("spec")
    if which == "attention":
        a = group.attention
        if a.layout not in ATTENTION_LAYOUTS:
            raise InvalidArgumentError(f"{field}.attention.layout", f"must be one of {ATTENTION_LAYOUTS}, got {a.layout!r}")
        if a.dtype not in ITEMSIZES:
            raise InvalidArgumentError(f"{field}.attention.dtype", f"unknown dtype {a.dtype!r}")
        strides = None
        if a.layout == "strided":
            if not a.HasField("strides"):
                raise InvalidArgumentError(f"{field}.attention.strides", "layout 'strided' needs the cache's strides")
            t = a.strides
            try:
                strides = CacheStrides(t.content, t.layer, t.block, t.head, t.token)
            except KvxferError as err:
                raise type(err)(f"{field}.attention.{err.field}", err.message) from None
        return AttentionSpec(a.layout, a.num_blocks, a.num_kv_heads, a.head_size, a.block_size,
                             a.kernel_block_size or None, a.dtype, a.num_layers or 1, strides)
    if which == "state":
        s = group.state
        for name in ("conv_dtype", "ssm_dtype"):
            if getattr(s, name) not in ITEMSIZES:
                raise InvalidArgumentError(f"{field}.state.{name}", f"unknown dtype {getattr(s, name)!r}")
        return MambaSpec(s.num_blocks, s.num_heads, s.head_dim, s.num_groups, s.state_size, s.conv_window,
                         s.conv_dtype, s.ssm_dtype, s.conv_order or "WD", s.page_bytes or None, s.block_stride or None,
                         s.num_layers or 1, s.layer_stride or None, s.conv_parts or "xBC")
    raise InvalidArgumentError(f"{field}.spec", "a cache group needs an attention or a state spec")


def spec_to_pb(spec: CacheSpec, out: pb.CacheGroup) -> None:
    """Write ``spec`` into a cache group message (the inverse of what ``groups_from_pb`` reads)."""
    if isinstance(spec, AttentionSpec):
        out.attention.CopyFrom(pb.AttentionCache(
            layout=spec.layout, num_blocks=spec.num_blocks, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            block_size=spec.block_size, kernel_block_size=spec.kernel_block_size or 0, dtype=spec.dtype,
            num_layers=spec.num_layers))
        if spec.strides is not None:
            t = spec.strides
            out.attention.strides.CopyFrom(pb.CacheStrides(content=t.content, layer=t.layer, block=t.block,
                                                           head=t.head, token=t.token))
    else:
        out.state.CopyFrom(pb.StateCache(
            num_blocks=spec.num_blocks, num_heads=spec.num_heads, head_dim=spec.head_dim, num_groups=spec.num_groups,
            state_size=spec.state_size, conv_window=spec.conv_window, conv_dtype=spec.conv_dtype,
            ssm_dtype=spec.ssm_dtype, conv_order=spec.conv_order, page_bytes=spec.page_bytes or 0,
            block_stride=spec.block_stride or 0, num_layers=spec.num_layers, layer_stride=spec.layer_stride or 0,
            conv_parts=spec.conv_parts))


def groups_from_pb(engine: pb.EngineRank) -> tuple[CacheGroup, ...]:
    """The cache groups of an engine rank message (specs validated)."""
    groups = []
    for g, group in enumerate(engine.groups):
        field = f"engine.groups[{g}]"
        spec = _spec_from_pb(group, field)
        try:
            groups.append(CacheGroup(group.kind, spec, max(len(group.regions), 1)))
            spec.region(engine.tp_size or 1, engine.tp_rank)  # sizes and TP fit this rank
        except KvxferError as err:
            raise type(err)(f"{field}.{err.field}", err.message) from None
    if not groups:
        raise InvalidArgumentError("engine.groups", "an engine needs at least one cache group")
    return tuple(groups)


def engine_from_pb(engine: pb.EngineRank, memory: Sequence[Sequence[RegionMemory]]) -> EngineCache:
    """An :class:`EngineCache` from a message and the memory the daemon mapped for it."""
    check_id(engine.engine_id, "engine.engine_id")
    groups = groups_from_pb(engine)
    try:
        return EngineCache(engine.engine_id, engine.tp_size, engine.tp_rank, groups,
                           tuple(tuple(m) for m in memory), engine.mem_type or "DRAM")
    except KvxferError as err:
        raise type(err)(f"engine.{err.field}", err.message) from None


def peer_memory_from_pb(engine: pb.EngineRank) -> list[list[RegionMemory]]:
    """Region addresses of a peer's engine (peer info carries addresses, and for a same-host reader what
    each region's memory can be opened by: :func:`share_from_pb`)."""
    return [[RegionMemory(r.address, r.num_bytes, r.device_id, share_from_pb(r, f"engine.groups[{g}].regions[{i}]"))
             for i, r in enumerate(group.regions)] for g, group in enumerate(engine.groups)]


def share_from_pb(region: pb.Region, field: str) -> HostShare | DeviceShare | VmmShare | None:
    """What a same-host peer named for opening its region itself, validated, or None when it sent nothing:
    host memory's shared-memory object (one name under /dev/shm, or the holder's open fd of it), or a GPU
    allocation's CUDA IPC handle (64 bytes) and the GPU's UUID."""
    handle = region.handle
    source = handle.WhichOneof("source")
    if source not in ("shm_name", "cuda_ipc_handle", "shm_fd_index", "cuda_vmm_fd_index"):
        return None
    if handle.offset < 0:
        raise InvalidArgumentError(f"{field}.handle.offset", f"must not be negative, got {handle.offset}")
    if source == "shm_fd_index":  # passed as an fd: the holder's open copy of it, in its process
        if not 0 < handle.holder_pid <= MAX_PID or not 0 <= handle.holder_fd < MAX_FD:
            raise InvalidArgumentError(f"{field}.handle.holder_fd", f"not a process and fd: pid {handle.holder_pid}, "
                                                                    f"fd {handle.holder_fd}")
        return HostShare("", handle.offset, handle.shm_device, handle.shm_inode, handle.holder_pid, handle.holder_fd)
    if source == "cuda_vmm_fd_index":
        try:
            return _vmm_share_from_pb(region, field)
        except InvalidArgumentError:  # the region is read over NIXL; the handshake stands
            return None
    if source == "cuda_ipc_handle":
        if len(handle.cuda_ipc_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgumentError(f"{field}.handle.cuda_ipc_handle", f"{len(handle.cuda_ipc_handle)} bytes, "
                                                                          f"a CUDA IPC handle has {IPC_HANDLE_BYTES}")
        if not GPU_UUID.fullmatch(region.device_uuid):
            raise InvalidArgumentError(f"{field}.device_uuid", f"{region.device_uuid[:80]!r} is not a GPU UUID")
        return DeviceShare(handle.cuda_ipc_handle, handle.offset, region.device_uuid)
    shm_path(handle.shm_name, f"{field}.handle")  # one component under /dev/shm, or InvalidArgumentError
    return HostShare(handle.shm_name, handle.offset, handle.shm_device, handle.shm_inode)


def _vmm_share_from_pb(region: pb.Region, field: str) -> VmmShare | None:
    """A same-host holder's VMM share (None when it named none: such a region is read over NIXL)."""
    handle = region.handle
    if not handle.share_token:
        return None
    path = handle.share_socket
    if not SHARE_TOKEN.fullmatch(handle.share_token):
        raise InvalidArgumentError(f"{field}.handle.share_token", "not 32 lower-case hex digits")
    if not (path.startswith("/") and path.isprintable() and len(path.encode()) <= SHARE_SOCKET_MAX_BYTES):
        raise InvalidArgumentError(f"{field}.handle.share_socket", f"not an absolute path of at most "
                                                                   f"{SHARE_SOCKET_MAX_BYTES} bytes: {path[:80]!r}")
    if not 0 < handle.holder_pid <= MAX_PID:
        raise InvalidArgumentError(f"{field}.handle.holder_pid", f"not a process: {handle.holder_pid}")
    if not 0 <= handle.offset < handle.allocation_bytes or region.num_bytes > handle.allocation_bytes - handle.offset:
        raise InvalidArgumentError(f"{field}.handle.allocation_bytes", f"the region [{handle.offset}, "
                                   f"{handle.offset + region.num_bytes}) is not inside an allocation of "
                                   f"{handle.allocation_bytes} bytes")
    if not GPU_UUID.fullmatch(region.device_uuid):
        raise InvalidArgumentError(f"{field}.device_uuid", f"{region.device_uuid[:80]!r} is not a GPU UUID")
    return VmmShare(handle.share_token, path, handle.holder_pid, handle.offset, handle.allocation_bytes,
                    region.device_uuid)


def engine_to_pb(cache: EngineCache, *, with_addresses: bool, with_shares: bool = False,
                 vmm_shares: bool = True) -> pb.EngineRank:
    """The message describing ``cache`` (for peers: with region addresses; for a proven same-host reader
    also what each region's memory can be opened by: :func:`share_from_pb`; ``vmm_shares=False``: not a GPU
    VMM allocation's token, for a process that must hold no key, a data-plane worker)."""
    out = pb.EngineRank(engine_id=cache.engine_id, tp_rank=cache.tp_rank, tp_size=cache.tp_size, mem_type=cache.mem_type)
    for group, memory in zip(cache.groups, cache.memory):
        message = out.groups.add(kind=group.kind)
        spec_to_pb(group.spec, message)
        for region in memory:
            added = message.regions.add(address=region.address if with_addresses else 0, num_bytes=region.num_bytes,
                                        device_id=region.device_id)
            share = region.share if with_shares else None
            if isinstance(share, HostShare):
                host_share_to_pb(share, added.handle)
            elif isinstance(share, DeviceShare):
                added.handle.cuda_ipc_handle, added.handle.offset = share.ipc_handle, share.offset
                added.device_uuid = share.device_uuid
            elif isinstance(share, VmmShare) and vmm_shares:  # (never to a worker: the token is a key)
                added.handle.cuda_vmm_fd_index = 0  # names the kind: the fd is served by the holder, below
                added.handle.share_token, added.handle.share_socket = share.token, share.socket_path
                added.handle.holder_pid, added.handle.offset = share.holder_pid, share.offset
                added.handle.allocation_bytes, added.device_uuid = share.allocation_bytes, share.device_uuid
    return out


def host_share_to_pb(share: HostShare, handle: pb.MemoryHandle) -> None:
    """Fill ``handle`` with a shared-memory object as a same-host reader opens it (:func:`share_from_pb`)."""
    if share.name:
        handle.shm_name = share.name
    else:
        handle.shm_fd_index = 0  # names the kind: the fd is the holder's, below
        handle.holder_pid, handle.holder_fd = share.holder_pid, share.holder_fd
    handle.offset = share.offset
    handle.shm_device, handle.shm_inode = share.device, share.inode


def host_share_hex(share: HostShare) -> str:
    """A shared-memory object as a ``MemoryHandle`` message, hex (a reader worker's ``connect`` carries its
    holders' boards so): read back by :func:`host_share_from_handle`."""
    handle = pb.MemoryHandle()
    host_share_to_pb(share, handle)
    return handle.SerializeToString().hex()


def host_share_from_handle(handle: pb.MemoryHandle, field: str) -> HostShare:
    """A ``MemoryHandle`` that must name host shared memory (a hold board's), validated as a region's is
    (:func:`share_from_pb`); :class:`InvalidArgumentError` naming ``field`` for anything else."""
    share = share_from_pb(pb.Region(handle=handle), field)
    if not isinstance(share, HostShare):
        raise InvalidArgumentError(field, "a board lies in host shared memory")
    return share


def ids_from_pb(lists: Sequence[pb.BlockIds]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(b.ids, dtype=np.int64) for b in lists)


def ids_to_pb(lists) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=np.asarray(ids, dtype=np.int64).tolist()) for ids in lists]


MAX_PACKED_ID = 2**31 - 1


def pack_ids(lists) -> tuple[bytes, list[int]]:
    """Block ids per group as one little-endian int32 buffer plus the count per group (``ReadSpec``)."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in lists]
    if not arrays:
        return b"", []
    joined = np.concatenate(arrays)
    if len(joined) and (joined.min() < 0 or joined.max() > MAX_PACKED_ID):
        raise InvalidArgumentError("block_ids", f"block ids must lie in [0, {MAX_PACKED_ID}]")
    return joined.astype("<i4").tobytes(), [len(a) for a in arrays]


def unpack_ids(data: bytes, sizes: Sequence[int], field: str) -> tuple[np.ndarray, ...]:
    """The inverse of :func:`pack_ids`, checked: whole int32s, as many as the group sizes announce."""
    if len(data) % 4:
        raise InvalidArgumentError(field, f"{len(data)} bytes is not a whole number of int32 ids")
    flat = np.frombuffer(data, dtype="<i4").astype(np.int64)
    if sum(sizes) != len(flat):
        raise InvalidArgumentError(field, f"the group sizes add up to {sum(sizes)} ids, {len(flat)} were sent")
    out, start = [], 0
    for size in sizes:
        out.append(flat[start:start + size])
        start += size
    return tuple(out)


def read_spec_to_pb(request_id: str, remote_engine_id: str, remote_request_id: str, local_block_ids,
                    remote_block_ids, num_tokens: int = 0, deadline_s: float = 0.0,
                    remote_capabilities=(), remote_digests=(), traceparent: str = "") -> pb.ReadSpec:
    """One read of a ``Reads`` batch (ids packed; ``remote_capabilities`` and ``remote_digests``: each remote
    rank's HoldReply's; ``traceparent``: the request's W3C trace context, wire/tracecontext.py)."""
    local, local_sizes = pack_ids(local_block_ids)
    remote, remote_sizes = pack_ids(remote_block_ids)
    return pb.ReadSpec(request_id=request_id, remote_engine_id=remote_engine_id, remote_request_id=remote_request_id,
                       local_block_ids=local, local_group_sizes=local_sizes, remote_block_ids=remote,
                       remote_group_sizes=remote_sizes, num_tokens=num_tokens, deadline_s=deadline_s,
                       remote_capabilities=list(remote_capabilities), remote_digests=list(remote_digests),
                       traceparent=traceparent)


def read_request_from_spec(spec: pb.ReadSpec) -> ReadRequest:
    """A read request from a ``Reads`` batch; ids are range-checked later by the plan, before any I/O."""
    return _read_request(spec.request_id, spec.remote_request_id, spec.num_tokens,
                         unpack_ids(spec.local_block_ids, spec.local_group_sizes, "local_block_ids"),
                         unpack_ids(spec.remote_block_ids, spec.remote_group_sizes, "remote_block_ids"),
                         spec.remote_capabilities, spec.remote_digests)


def _read_request(request_id: str, remote_request_id: str, num_tokens: int, local, remote,
                  capabilities, digests=()) -> ReadRequest:
    check_id(request_id, "request_id")
    check_id(remote_request_id, "remote_request_id")
    if num_tokens < 0:
        raise InvalidArgumentError("num_tokens", f"must not be negative, got {num_tokens}")
    if len(capabilities) > MAX_TP_SIZE:
        raise InvalidArgumentError("remote_capabilities", f"{len(capabilities)} capabilities, at most {MAX_TP_SIZE}")
    checked = tuple(check_capability_bytes(c, f"remote_capabilities[{q}]") for q, c in enumerate(capabilities))
    if len(digests) > MAX_TP_SIZE:
        raise InvalidArgumentError("remote_digests", f"{len(digests)} ranks' digests, at most {MAX_TP_SIZE}")
    decoded = tuple(HoldDigests.decode(d, f"remote_digests[{q}]") for q, d in enumerate(digests))
    return ReadRequest(request_id, remote_request_id, local, remote, num_tokens or None, checked, decoded)


def has_calls(batch) -> bool:
    """Whether a ``ReadBatch`` carries calls (holds, renewals, releases, final layers): most carry reads only."""
    return bool(batch.holds or batch.renewals or batch.releases or batch.final_layers)
