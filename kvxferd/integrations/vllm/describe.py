"""Describe an engine's KV cache tensors to its daemon, without copying them.

Host tensors: each distinct storage is moved into shared memory *in place*
(``share_memory_()``: the storage's bytes move to a shared-memory object
and every tensor viewing it follows), then its fd travels to the daemon
over the fd socket; a region is that fd plus the layer's offset in it::

    storage (one per KV cache tensor, many layers)   fd k
    ├─ layer 0  [offset 0,        num_bytes)         region: shm_fd_index=k, offset=0
    ├─ layer 1  [offset stride,   num_bytes)         region: shm_fd_index=k, offset=stride
    └─ ...

CUDA tensors: the IPC handle of the allocation plus the region's offset
in it, or, for memory CUDA IPC cannot share but ``cuMemCreate`` made
exportable as a POSIX fd, the allocation's VMM fd, sent like host fds
(:func:`kvxferd.client.gpu.export_region`; vLLM's sleep-mode memory is
neither and is refused). vLLM 0.32 allocates the whole cache at once, so
every group shares one handle.

Nothing here imports vLLM: the connector turns vLLM's cache config into
:class:`GroupLayout` values first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvxferd.layout.region import Shard
from kvxferd.layout.specs import ATTENTION_LAYOUTS, AttentionSpec, CacheStrides
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import spec_to_pb

if TYPE_CHECKING:
    from kvxferd.client.gpu import GpuExport

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.uint8: "uint8",
                torch.int8: "int8"}


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group as the daemon needs to see it."""

    kind: str  # full | swa | mla
    layer_names: tuple[str, ...]
    layout: str  # a kvxferd attention layout name
    num_blocks: int  # logical blocks
    num_kv_heads: int  # over all TP ranks (1 for MLA)
    head_size: int
    block_size: int
    kernel_block_size: int
    dtype: str
    strides: CacheStrides | None = None  # "strided": one region for every layer of the group

    def __post_init__(self) -> None:
        if self.layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {ATTENTION_LAYOUTS}")

    @property
    def one_region(self) -> bool:
        """Whether one region holds every layer (else one region per layer)."""
        return self.layout == "strided"

    def spec(self) -> AttentionSpec:
        """The kvxferd spec of one region of this group."""
        return AttentionSpec(self.layout, self.num_blocks, self.num_kv_heads, self.head_size, self.block_size,
                             None if self.kernel_block_size == self.block_size else self.kernel_block_size,
                             self.dtype, len(self.layer_names) if self.layout == "strided" else 1, self.strides)


class CacheContent(NamedTuple):
    """What one (head, token) of a layer view holds, as kvxferd describes it."""

    kind: str  # kv | k_transposed | latent | bytes (kvxferd.layout.builders.CacheStrides)
    dtype: str
    head_size: int  # of K (and V) for kv; the whole content for latent and bytes

    @property
    def size(self) -> int:
        """Elements of the view's last dim."""
        return 2 * self.head_size if self.kind in ("kv", "k_transposed") else self.head_size


def cache_content(kind: str, spec, dtype: torch.dtype) -> CacheContent:
    """The content of vLLM's ``[B, H, N, C]`` view from its cache spec's fields (vLLM-free: read by name).

    ``C`` holds ``head_size`` K elements then ``head_size_v`` V elements
    unless the spec says it holds more (``state_content_bytes``: scales
    beside them), in which case each (head, token) moves whole as bytes.
    """
    itemsize = dtype.itemsize
    content_bytes = spec.state_content_size_bytes
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise ValueError(f"each state holds {spec.tokens_per_state} tokens (a compressed cache), which kvxferd does not "
                         "describe yet")
    slots = getattr(spec, "num_head_slots", None)
    if slots is not None:  # even when it equals the head count: the slots are then K and V, not heads
        raise ValueError(f"{slots} head slots for {spec.num_kv_heads} KV heads (the backend packs K and V as slots "
                         "of their own: nvfp4's K heads then V heads, ROCm's x-packed K slot and V slot), which "
                         "kvxferd does not describe yet")
    if kind == "mla":
        if content_bytes == spec.head_size * itemsize:
            return CacheContent("latent", torch_dtype_name(dtype), spec.head_size)
        return CacheContent("latent", "uint8", content_bytes)  # fp8 latents with their scales: opaque per token
    if spec.head_size_v != spec.head_size:
        raise ValueError(f"K has {spec.head_size} channels and V {spec.head_size_v}, which kvxferd does not describe yet")
    if content_bytes == 2 * spec.head_size * itemsize:
        return CacheContent("kv", torch_dtype_name(dtype), spec.head_size)
    return CacheContent("bytes", "uint8", content_bytes)


def layer_strides(layers: Sequence[torch.Tensor], content: str, content_size: int) -> CacheStrides:
    """The strides of a group's per-layer ``[B, H, N, C]`` views over one allocation (vLLM >= 0.32).

    vLLM views every layer of a group with the same strides, layer ``l``
    starting ``l * layer_stride`` bytes after layer 0 (any physical order:
    the layer dim may sit outside or inside the block dim). That is all
    kvxferd needs: the strides come from the tensors, never from a name.
    """
    layers = [layer.view(torch.uint8) if content == "bytes" else layer for layer in layers]  # C counted in bytes
    first = layers[0]
    if first.dim() != 4 or first.stride(3) != 1 or first.shape[3] != content_size:
        raise ValueError(f"a layer is viewed as {tuple(first.shape)} with strides {first.stride()}; expected "
                         f"(blocks, heads, tokens, {content_size}) with each (head, token)'s content contiguous")
    step = layer_step_bytes(layers)
    if step % first.element_size():
        raise ValueError(f"the layers follow each other at {step} bytes, not a whole element")
    block, head, token, _ = first.stride()
    return CacheStrides(content, step // first.element_size(), block, head, token)


def layer_step_bytes(layers: Sequence[torch.Tensor]) -> int:
    """Bytes from one layer's view to the next's (0 for one layer): every view alike, in one allocation,
    each the same positive step after the last; anything else is refused."""
    first = layers[0]
    storage = first.untyped_storage().data_ptr()
    for i, tensor in enumerate(layers):
        if (tensor.shape, tensor.stride(), tensor.dtype) != (first.shape, first.stride(), first.dtype):
            raise ValueError(f"layer {i} is viewed as {tuple(tensor.shape)} {tensor.stride()} {tensor.dtype}, layer 0 as "
                             f"{tuple(first.shape)} {first.stride()} {first.dtype}: a group's layers must share one view")
        if tensor.untyped_storage().data_ptr() != storage:
            raise ValueError(f"layer {i} is not in the same allocation as layer 0")
    steps = {b.data_ptr() - a.data_ptr() for a, b in zip(layers, layers[1:])}
    if len(steps) > 1 or any(step <= 0 for step in steps):
        raise ValueError(f"the layers do not follow each other at one stride (steps {sorted(steps)} bytes)")
    return steps.pop() if steps else 0


def strided_group(kind: str, layer_names: Sequence[str], layers: Sequence[torch.Tensor], spec, total_heads: int,
                  content_reader: Callable[[], str] | None = None, *, tp_size: int = 1, tp_rank: int = 0) -> GroupLayout:
    """A group of vLLM (>= 0.32) layer views as one ``strided`` region of TP rank ``tp_rank`` of ``tp_size``.

    ``spec`` is vLLM's cache spec of the group (read by field name);
    ``content_reader()`` names the content for a backend whose kernels
    reinterpret it (CPU attention). The views must hold exactly the heads
    the daemon will take this rank to hold: a view of other heads is refused.
    """
    num_kernel_blocks, num_heads, kernel_block_size, _ = layers[0].shape
    content = cache_content(kind, spec, layers[0].dtype)  # first: head slots are refused as what they are
    start, stop = Shard("H", 1 if kind == "mla" else total_heads, tp_size, tp_rank).local_range
    if num_heads != stop - start or (kind != "mla" and spec.num_kv_heads != num_heads):
        raise ValueError(f"the layer views hold {num_heads} heads and the spec {spec.num_kv_heads}, but rank {tp_rank} of "
                         f"{tp_size} holds {stop - start} of {total_heads if kind != 'mla' else 1}")
    if content_reader is not None and content.kind == "kv":
        content = content._replace(kind=content_reader())
    return GroupLayout(kind=kind, layer_names=tuple(layer_names), layout="strided",
                       num_blocks=num_kernel_blocks * kernel_block_size // spec.block_size,
                       num_kv_heads=1 if kind == "mla" else total_heads, head_size=content.head_size,
                       block_size=spec.block_size, kernel_block_size=kernel_block_size, dtype=content.dtype,
                       strides=layer_strides(layers, content.kind, content.size))


def torch_dtype_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"KV cache dtype {dtype} is not supported by kvxferd ({sorted(TORCH_DTYPES.values())})") from None


def torch_device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as nvidia-smi prints it (``GPU-`` and lower-case 8-4-4-4-12 hex)."""
    uuid = str(torch.cuda.get_device_properties(index).uuid).lower().removeprefix("gpu-")
    return f"GPU-{uuid}"


def share_host_storages(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[tuple[int, int]]]:
    """Move every distinct storage of ``tensors`` into shared memory in place.

    Returns the fds (one per storage) and, per tensor, ``(fd index, byte
    offset of the tensor in its storage)``. The fds stay owned by torch.
    """
    fds: list[int] = []
    by_storage: dict[int, int] = {}
    placement = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in by_storage:
            if not storage.is_shared():
                storage.share_memory_()
            fd, _size = storage._share_fd_cpu_()
            by_storage[storage.data_ptr()] = len(fds)
            fds.append(fd)
        placement.append((by_storage[storage.data_ptr()], tensor.data_ptr() - storage.data_ptr()))
    return fds, placement


def describe_engine(engine_id: str, tp_rank: int, tp_size: int, groups: Sequence[GroupLayout],
                    tensors: Mapping[str, torch.Tensor], *,
                    export_gpu: Callable[[int, int], "GpuExport"] | None = None,
                    device_uuid: Callable[[int], str] | None = None) -> tuple[pb.EngineRank, list[int]]:
    """The ``Register`` message of one engine rank and the fds to send first (host memory).

    A ``strided`` group is one region that starts at its first layer's
    element 0 and spans every layer (the layers' views may interleave).
    Otherwise every layer tensor must be contiguous and is one region.
    ``export_gpu`` ((address, bytes) -> :class:`~kvxferd.client.gpu.GpuExport`)
    shares CUDA regions: an IPC handle, or a VMM allocation's fd, which is
    then sent with the others (default: :func:`kvxferd.client.gpu.export_region`);
    ``device_uuid`` (device index -> ``GPU-...``) names their GPU, so the
    daemon opens them on the same GPU whatever index it sees it under
    (default: torch's).
    """
    bases = [(g, name) for g, group in enumerate(groups)
             for name in (group.layer_names[:1] if group.one_region else group.layer_names)]
    if not bases:
        raise ValueError("no KV cache layers to register")
    on_gpu = {tensors[name].device.type == "cuda" for _, name in bases}
    if len(on_gpu) != 1:
        raise ValueError("KV cache layers are partly on the GPU and partly in host memory")
    on_gpu = on_gpu.pop()
    fds, placement = ([], []) if on_gpu else share_host_storages([tensors[name] for _, name in bases])
    if on_gpu and export_gpu is None:
        from kvxferd.client.gpu import export_region as export_gpu
    if on_gpu and device_uuid is None:
        device_uuid = torch_device_uuid
    engine = pb.EngineRank(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, mem_type="VRAM" if on_gpu else "DRAM")
    specs = [group.spec() for group in groups]
    messages = []
    for group, spec in zip(groups, specs):
        message = engine.groups.add(kind=group.kind)
        spec_to_pb(spec, message)
        messages.append(message)
    for n, (g, name) in enumerate(bases):
        tensor, group = tensors[name], groups[g]
        if group.one_region:
            num_bytes = specs[g].region(tp_size, tp_rank).num_bytes
        elif tensor.is_contiguous():
            num_bytes = tensor.numel() * tensor.element_size()
        else:
            raise ValueError(f"groups[{g}] layer {name!r}: the KV cache tensor is not contiguous")
        region = messages[g].regions.add(num_bytes=num_bytes)
        if on_gpu:
            exported = export_gpu(tensor.data_ptr(), num_bytes)
            region.handle.offset = exported.offset
            if exported.vmm_fd >= 0:  # kept open: a daemon restart is sent the same fd again
                region.handle.cuda_vmm_fd_index, region.handle.allocation_bytes = len(fds), exported.allocation_bytes
                region.handle.rdma_capable = exported.rdma_capable
                fds.append(exported.vmm_fd)
            else:
                region.handle.cuda_ipc_handle = exported.ipc_handle
            region.device_id = tensor.device.index or 0
            region.device_uuid = device_uuid(region.device_id)
        else:
            region.handle.shm_fd_index, region.handle.offset = placement[n]
            if placement[n][1] + num_bytes > tensor.untyped_storage().nbytes():
                raise ValueError(f"groups[{g}]: the region of {num_bytes} bytes from layer {name!r} runs past its "
                                 "allocation")
    return engine, fds
