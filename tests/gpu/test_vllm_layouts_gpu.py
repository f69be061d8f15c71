"""vLLM-shaped GPU caches through the connector's pieces and real daemons (CUDA IPC, device UUIDs).

The caches are laid out as vLLM 0.32's allocator does (one int8 CUDA buffer,
one strided ``[B, H, N, K|V]`` view per layer; tests/integrations checks the
views equal vLLM's own), described by the connector from the views, exported
as one CUDA IPC handle per group, found by the daemon by GPU UUID, and read
across two physical orders, two TP sizes and two block sizes. Runs only
where ``torch.cuda.is_available()``.
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

from kvxferd.integrations.vllm.describe import strided_group  # noqa: E402
from tests.integrations.layer_tags import (attention_spec, one_group_read, strided_layer_views, tag_through_views,  # noqa: E402
                                           wrong_decode_blocks)


@pytest.mark.parametrize("prefill_order, decode_order, misdescribed", [
    ("LBNHC", "LBHNC", False), ("BLHNC", "LBNHC", False), ("LBNHC", "LBHNC", True)])
def test_vllm_shaped_vram_reads_across_orders(tmp_path, prefill_order, decode_order, misdescribed):
    prefill_spec, decode_spec = attention_spec(2, 64, 32, torch.bfloat16), attention_spec(4, 64, 16, torch.bfloat16)
    prefill_layers = [strided_layer_views(prefill_order, 2, 8, 2, 32, 64, torch.bfloat16, "cuda") for _ in range(2)]
    decode_layers = strided_layer_views(decode_order, 2, 12, 4, 16, 64, torch.bfloat16, "cuda")
    for rank, layers in enumerate(prefill_layers):
        tag_through_views(layers, 32, first_head=2 * rank)
    names = ["l0", "l1"]
    prefill_groups = [strided_group("full", names, layers, prefill_spec, 4, tp_size=2, tp_rank=r)
                      for r, layers in enumerate(prefill_layers)]
    decode_group = strided_group("full", names, decode_layers, decode_spec, 4)
    if misdescribed:  # negative control: LBHNC memory described with LBNHC's head and token strides
        s = decode_group.strides
        decode_group = dataclasses.replace(decode_group, strides=dataclasses.replace(s, head=s.token, token=4 * s.token))
    one_group_read(tmp_path, prefill_groups, prefill_layers, decode_group, decode_layers, remote_ids=[5, 2],
            decode_ids=[9, 1, 4, 7], num_tokens=60)
    torch.cuda.synchronize()
    wrong = wrong_decode_blocks(decode_layers, 16, [9, 1, 4, 7], [5, 2], 32)
    assert bool(wrong) == misdescribed, wrong
