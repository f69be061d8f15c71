"""Engine ranks whose caches live on a CUDA GPU: for ``tests/gpu`` and ``kvxferd bench gpu``.

The oracle stays on the host. An :class:`EngineBuffers` arena (tagged for a
prefill rank) is copied into one CUDA allocation of the same size, and the
cache the daemon registers is the same layout at the device's addresses::

    host arena   [gap|region 0|gap|region 1|gap ...]   checked by verify_decode
                   | upload()          ^ download()
                   v                   |
    CUDA tensor  [gap|region 0|gap|region 1|gap ...]   registered (VRAM, IPC handle)

Needs a CUDA build of torch, imported on first use, so this module imports
anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvxferd.plan.groups import CacheGroup, EngineCache, RegionMemory
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.verify.buffers import EngineBuffers, allocate_engine
from kvxferd.wire.messages import engine_to_pb


def cuda_missing() -> str:
    """Why GPU caches cannot be made here ("" when they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (a CUDA build of torch and a GPU are needed)"
    return ""


@dataclass(eq=False)
class GpuEngine:
    """One engine rank: host buffers (the oracle's copy), the CUDA tensor, and its cache at device addresses."""

    host: EngineBuffers
    tensor: object  # torch.Tensor, uint8, on the device
    cache: EngineCache  # mem_type VRAM

    @classmethod
    def allocate(cls, engine_id: str, groups: Sequence[CacheGroup], tp_size: int, tp_rank: int, *, tagged: bool,
                 device_id: int = 0) -> "GpuEngine":
        """Allocate (and tag, for a prefill rank) on the host, then copy it all to ``cuda:device_id``."""
        import torch

        host = allocate_engine(engine_id, groups, tp_size, tp_rank, tagged=tagged)
        tensor = torch.from_numpy(host.arena).to(f"cuda:{device_id}")
        shift = tensor.data_ptr() - host.base_address
        memory = tuple(tuple(RegionMemory(r.address + shift, r.num_bytes, device_id) for r in regions)
                       for regions in host.cache.memory)
        cache = EngineCache(engine_id, tp_size, tp_rank, tuple(groups), memory, mem_type="VRAM")
        return cls(host, tensor, cache)

    def register_pb(self, ipc_handle: tuple[bytes, int] | None = None) -> pb.EngineRank:
        """The Register message: every region as an offset into the tensor's allocation, shared by CUDA IPC.

        ``ipc_handle``: ``(handle, offset of the tensor in its allocation)``,
        e.g. the bare 64-byte ``cudaIpcMemHandle_t`` from
        :func:`kvxferd.client.gpu.export_ipc`; by default torch's own
        ``_share_cuda_()`` encoding, as an engine sharing a storage has it.
        """
        if ipc_handle is None:
            _device, handle, _size, tensor_offset, *_ = self.tensor.untyped_storage()._share_cuda_()
        else:
            handle, tensor_offset = ipc_handle
        message = engine_to_pb(self.cache, with_addresses=False)
        base = self.tensor.data_ptr()
        for group_pb, memory in zip(message.groups, self.cache.memory):
            for region_pb, region in zip(group_pb.regions, memory):
                region_pb.handle.cuda_ipc_handle = handle
                region_pb.handle.offset = tensor_offset + region.address - base
                region_pb.device_id = region.device_id
        return message

    def download(self) -> None:
        """Copy the device's bytes back into the host arena (after every read to check has completed)."""
        import torch

        torch.cuda.synchronize(self.tensor.device)
        self.host.arena[...] = self.tensor.cpu().numpy()

    def reset(self) -> None:
        """Back to the sentinel on the host and on the device (decode side, between checks)."""
        import torch

        self.host.reset()
        self.tensor.copy_(torch.from_numpy(self.host.arena))
        torch.cuda.synchronize(self.tensor.device)
