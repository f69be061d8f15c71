"""vLLM's own KV cache allocator on CPU, and coordinate tags written through its layer views.

``allocate`` runs vLLM's ``get_kv_cache_config_from_groups`` and
``allocate_kv_cache`` (the code that lays out a GPU engine's cache; it runs on
any device) for one group of layers. ``tag_through_views`` writes, through
vLLM's own ``[B, H, N, C]`` views, a byte tag derived from every byte's
(layer, logical block, global head, logical token, content byte);
``read_our_way`` reads the same bytes where kvxferd's description of the
group says they are. Needs vLLM (``.venv-vllm``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvxferd.integrations.vllm.describe import GroupLayout
from tests.layout.brute import addresses


def allocate(spec, num_layers: int, num_blocks: int, layout, kernel_block_size: int | None = None):
    """``(layer views, KVCacheConfig)`` of one group of ``num_layers`` layers, as a vLLM worker allocates it."""
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=None)
    config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)],
                                                      num_blocks * num_layers * spec.page_size_bytes)
    kernels = None if kernel_block_size is None else [kernel_block_size]
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernels)
    return [views[name] for name in names], kv_cache_config


def byte_tags(layer, block, head, token, content_byte) -> np.ndarray:
    """A byte from the coordinates (broadcast); a wrong mapping hits another tag ~255 times in 256."""
    with np.errstate(over="ignore"):
        h = (np.asarray(layer, np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.asarray(block, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             ^ np.asarray(head, np.uint64) * np.uint64(0x94D049BB133111EB))
        h = (h ^ (h >> np.uint64(29))) * np.uint64(0xD6E8FEB86659FD93) + np.asarray(token, np.uint64) * np.uint64(31337)
        h = (h ^ (h >> np.uint64(32))) * np.uint64(0xC2B2AE3D27D4EB4F) + np.asarray(content_byte, np.uint64)
        h = h ^ (h >> np.uint64(31))
    return (h * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(56)).astype(np.uint8)


def tag_through_views(layers, block_size: int, first_head: int) -> None:
    """Write every byte of every layer through vLLM's view (``first_head``: this TP rank's first global head)."""
    for l, view in enumerate(layers):
        raw = view.view(torch.uint8)  # [Bk, H, Nk, content bytes]
        num_kernel_blocks, heads, kernel, width = raw.shape
        k = block_size // kernel
        bk = np.arange(num_kernel_blocks).reshape(-1, 1, 1, 1)
        tags = byte_tags(l, bk // k, np.arange(heads).reshape(1, -1, 1, 1) + first_head,
                         (bk % k) * kernel + np.arange(kernel).reshape(1, 1, -1, 1), np.arange(width).reshape(1, 1, 1, -1))
        raw.copy_(torch.from_numpy(tags))


def storage_bytes(tensor: torch.Tensor) -> np.ndarray:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()


def read_our_way(group: GroupLayout, layers, tp_size: int, tp_rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per field: (the bytes kvxferd's region addresses, the tags vLLM's views wrote there).

    The expected tags follow each content's own reading of a (head, token):
    ``kv`` K then V; ``latent`` and ``bytes`` whole; ``k_transposed`` as vLLM's CPU
    attention reads a head's kernel block (``key_cache.view(B, H, 2 * N, C)`` style:
    K as C x N, then V as N x C).
    """
    region = group.spec().region(tp_size, tp_rank)
    base = layers[0].data_ptr() - layers[0].untyped_storage().data_ptr()
    memory = storage_bytes(layers[0])
    item = np.dtype(np.uint8).itemsize if group.dtype == "uint8" else layers[0].element_size()
    out = {}
    for field in region.fields:
        dims = field.layout.dims
        where = addresses(field.layout, dims)[..., None] * item + np.arange(item) + base
        coords = {d: np.arange(field.layout.size(d)).reshape([-1 if i == j else 1 for j in range(len(dims))] + [1])
                  for i, d in enumerate(dims)}
        byte = np.arange(item)
        head = coords.get("H", 0) + (field.shard.local_range[0] if field.shard else 0)
        kernel = group.kernel_block_size
        if field.name in ("k", "v"):  # k_transposed: position inside the head's kernel block of 2 x N x C
            n, c = coords["N"], coords["C"]
            flat = c * kernel + n % kernel if field.name == "k" else kernel * group.head_size + (n % kernel) * group.head_size + c
            token = (n // kernel) * kernel + flat // (2 * group.head_size)
            content_byte = (flat % (2 * group.head_size)) * item + byte
        else:
            token = coords["N"]
            channel = coords["C"] + coords.get("KV", 0) * group.head_size
            content_byte = channel * item + byte
        expected = byte_tags(coords["L"], coords["B"], head, token, content_byte)
        out[field.name] = memory[where], np.broadcast_to(expected, where.shape)
    return out
