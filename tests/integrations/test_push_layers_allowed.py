"""Where the connector lets a push go layer by layer (``layers_can_be_pushed``), from vLLM's config alone.

Layer by layer writes a layer while the forward pass goes on, so two things must hold: the worker can
tell when a layer's KV is in the cache (a CPU, or a fenced CUDA stream; no micro-batches), and vLLM
keeps a prompt's blocks while its step may still run (with async scheduling it defers that free only
for a KV consumer).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvxferd.integrations.vllm.connector import layers_can_be_pushed


def config(device="cpu", ubatching=False, batches=1, role="kv_both"):
    transfer = SimpleNamespace(is_kv_consumer=role in ("kv_both", "kv_consumer"))
    return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                           parallel_config=SimpleNamespace(use_ubatching=ubatching),
                           kv_transfer_config=transfer, max_concurrent_batches=batches)


@pytest.mark.parametrize("kwargs, allowed", [
    ({}, True),
    ({"device": "cuda"}, True),
    ({"device": "xpu"}, False),  # no fence for its stream
    ({"ubatching": True}, False),  # a layer runs once per micro-batch
    ({"batches": 2}, True),  # async scheduling, kv_both: vLLM defers the free of in-flight blocks
    ({"batches": 2, "role": "kv_consumer"}, True),
    ({"batches": 2, "role": "kv_producer"}, False),  # ... not for a producer: a preempted prefill's blocks go
    ({"role": "kv_producer"}, True),  # one batch at a time: a step ends before anything is preempted
])
def test_layer_by_layer_only_where_each_layer_is_known_final_and_its_blocks_stay(kwargs, allowed):
    assert layers_can_be_pushed(config(**kwargs)) is allowed
