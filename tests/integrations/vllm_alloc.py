"""vLLM's own KV cache allocator on CPU (needs vLLM: ``.venv-vllm``).

``allocate`` runs vLLM's ``get_kv_cache_config_from_groups`` and
``allocate_kv_cache`` (the code that lays out a GPU engine's cache; it runs on
any device) for one group of layers.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache


def _config(layout) -> SimpleNamespace:
    """The fields of VllmConfig that vLLM's cache sizing reads, with ``layout`` resolved."""
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, prefix_cache_retention_interval=None,
                            num_gpu_blocks_override=None)
    return SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))


def allocate(spec, num_layers: int, num_blocks: int, layout, kernel_block_size: int | None = None):
    """``(layer views, KVCacheConfig)`` of one group of ``num_layers`` layers, as a vLLM worker allocates it."""
    config = _config(layout)
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)],
                                                      num_blocks * num_layers * spec.page_size_bytes)
    kernels = None if kernel_block_size is None else [kernel_block_size]
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernels)
    return [views[name] for name in names], kv_cache_config


def allocate_groups(specs, num_layers: int, num_blocks: int, layout):
    """Several groups of ``num_layers`` layers each (e.g. full attention and sliding window): vLLM overlays
    them from byte 0 of one allocation, a block id belonging to one group at a time. Views per group."""
    config = _config(layout)
    names = [[f"model.layers.{g}.{i}.attn" for i in range(num_layers)] for g in range(len(specs))]
    groups = [KVCacheGroupSpec(group_names, spec) for group_names, spec in zip(names, specs)]
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, num_blocks * num_layers * specs[0].page_size_bytes)
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    return [[views[name] for name in group_names] for group_names in names], kv_cache_config
