"""Larger sweeps, run on request: ``scripts/test.sh -m slow``."""

import itertools

import pytest

from kvxferd.layout.specs import AttentionSpec, MambaSpec

from tests.rig.verify.test_sweep import check

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["packed_HND", "split_kv", "mla", "cross_layer"])
def test_attention_tp_up_to_16(layout):
    for heads, p, d in itertools.product([1, 3, 8, 12, 16, 40], range(1, 17), range(1, 17)):
        spec = AttentionSpec(layout, num_blocks=4, num_kv_heads=heads, head_size=2, block_size=4,
                             kernel_block_size=2, num_layers=2)
        check(spec, spec.with_(kernel_block_size=None), p, d)


def test_mamba_tp_up_to_16():
    for heads, groups, p, d in itertools.product([4, 24], [1, 8], range(1, 17), range(1, 17)):
        spec = MambaSpec(num_blocks=3, num_heads=heads, head_dim=2, num_groups=groups, state_size=2, conv_window=2)
        check(spec, spec.with_(conv_order="DW"), p, d)
