"""Describe an engine's KV cache tensors to its daemon, without copying them.

Host tensors: each distinct storage is moved into shared memory *in place*
(``share_memory_()``: the storage's bytes move to a shared-memory object
and every tensor viewing it follows), then its fd travels to the daemon
over the fd socket; a region is that fd plus the layer's offset in it::

    storage (one per KV cache tensor, many layers)   fd k
    ├─ layer 0  [offset 0,        num_bytes)         region: shm_fd_index=k, offset=0
    ├─ layer 1  [offset stride,   num_bytes)         region: shm_fd_index=k, offset=stride
    └─ ...

CUDA tensors: the IPC handle of the allocation plus the offset of the
layer in it (:func:`kvxferd.service.gpu.export_ipc`).

Nothing here imports vLLM: the connector turns vLLM's cache config into
:class:`GroupLayout` values first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvxferd.layout.specs import ATTENTION_LAYOUTS
from kvxferd.proto.v1 import kvxfer_pb2 as pb

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

    def __post_init__(self) -> None:
        if self.layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {ATTENTION_LAYOUTS}")


def torch_dtype_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"KV cache dtype {dtype} is not supported by kvxferd ({sorted(TORCH_DTYPES.values())})") from None


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
                    export_ipc: Callable[[int], tuple[bytes, int]] | None = None) -> tuple[pb.EngineRank, list[int]]:
    """The ``Register`` message of one engine rank and the fds to send first (host memory).

    Every layer tensor must be contiguous and hold exactly its group's
    region for this rank; each is one region. ``export_ipc`` (address ->
    handle, offset) describes CUDA tensors (default:
    :func:`kvxferd.service.gpu.export_ipc`).
    """
    layers = [tensors[name] for group in groups for name in group.layer_names]
    if not layers:
        raise ValueError("no KV cache layers to register")
    on_gpu = {t.device.type == "cuda" for t in layers}
    if len(on_gpu) != 1:
        raise ValueError("KV cache layers are partly on the GPU and partly in host memory")
    on_gpu = on_gpu.pop()
    fds, placement = ([], []) if on_gpu else share_host_storages(layers)
    if on_gpu and export_ipc is None:
        from kvxferd.service.gpu import export_ipc
    engine = pb.EngineRank(engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, mem_type="VRAM" if on_gpu else "DRAM")
    n = 0
    for g, group in enumerate(groups):
        message = engine.groups.add(kind=group.kind)
        message.attention.CopyFrom(pb.AttentionCache(
            layout=group.layout, num_blocks=group.num_blocks, num_kv_heads=group.num_kv_heads,
            head_size=group.head_size, block_size=group.block_size,
            kernel_block_size=0 if group.kernel_block_size == group.block_size else group.kernel_block_size,
            dtype=group.dtype))
        for name in group.layer_names:
            tensor = tensors[name]
            if not tensor.is_contiguous():
                raise ValueError(f"groups[{g}] layer {name!r}: the KV cache tensor is not contiguous")
            region = message.regions.add(num_bytes=tensor.numel() * tensor.element_size())
            if on_gpu:
                handle, offset = export_ipc(tensor.data_ptr())
                region.handle.cuda_ipc_handle, region.handle.offset = handle, offset
                region.device_id = tensor.device.index or 0
            else:
                region.handle.shm_fd_index, region.handle.offset = placement[n]
            n += 1
    return engine, fds
