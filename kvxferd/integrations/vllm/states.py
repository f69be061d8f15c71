"""vLLM's Mamba2 and GDN state groups as kvxferd state pages (vLLM-free: the spec is read by field name).

vLLM 0.32 views every Mamba layer as ``[B, 1, 1, page]`` int8 over the one
cache allocation; a hybrid model's cache is block-outer, so a layer's pages
sit a whole block row apart and the layers of a block side by side::

    | blk 0 [ attn L0 | attn L1 | mamba L0 page | mamba L1 page ] | blk 1 [ ... ] |
                                  conv state (W x D or D x W), then SSM state (heads, head_dim, state)

One region holds every layer of the group (:class:`~kvxferd.layout.specs.MambaSpec`
with ``block_stride`` and ``layer_stride``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxferd.integrations.vllm.describe import layer_step_bytes, torch_dtype_name
from kvxferd.layout.specs import MambaSpec


# The state types described, by vLLM's mamba_type, and the order of their conv channels. GDN's conv state
# is [q | k | v] on each rank: vLLM 0.32 splits it [key_dim / tp, key_dim / tp, value_dim / tp]
# (GatedDeltaNetAttention.rearrange_mixed_qkv, vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py),
# and its SSM state is (value heads, value dim, key dim) (MambaStateShapeCalculator.gated_delta_net_state_shape):
# value heads play Mamba2's heads, key heads its groups.
CONV_PARTS_BY_TYPE = {"MAMBA2": "xBC", "GDN_ATTN": "BCx"}


@dataclass(frozen=True)
class StateGroup:
    """A Mamba2 or GDN state group of vLLM (>= 0.32) as one region holding every layer's pages."""

    kind: str  # mamba
    layer_names: tuple[str, ...]
    state: MambaSpec
    one_region = True

    def spec(self) -> MambaSpec:
        return self.state


def mamba_group(layer_names: Sequence[str], layers: Sequence[torch.Tensor], spec, *, conv_dim_first: bool,
                num_groups: int | None, tp_size: int = 1, tp_rank: int = 0) -> StateGroup:
    """A group of vLLM Mamba2 or GDN layers (``[B, 1, 1, page]`` int8 views) as kvxferd's :class:`MambaSpec`.

    vLLM packs a page as the conv state then the SSM state, unpadded
    (``MambaBase.bind_kv_cache``); the conv channels are ``[x | B | C]``
    (heads x head_dim, then two groups x state) and the SSM state is
    ``(heads, head_dim, state)``, each this rank's share. ``num_groups`` is
    the model's (``n_groups``; GDN: key heads); without it the rank's share times TP.
    GDN is the same page with the conv channels ``[q | k | v]`` (see :data:`CONV_PARTS_BY_TYPE`).
    """
    mamba_type = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if mamba_type not in CONV_PARTS_BY_TYPE or len(spec.shapes) != 2:
        raise ValueError(f"{mamba_type} state ({len(spec.shapes)} states) is not described yet (the conv and SSM "
                         f"states of {' and '.join(CONV_PARTS_BY_TYPE)} are)")
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "none":
        # vLLM keeps several state slots per request then (prefix caching of states); kvxferd holds
        # and reads one page per request and does not pick the running one out yet.
        raise ValueError(f"mamba_cache_mode {mode!r} (prefix caching of states) is not supported yet: run with "
                         "--no-enable-prefix-caching")
    if getattr(spec, "num_speculative_blocks", 0):
        raise ValueError(f"{spec.num_speculative_blocks} speculative state slots per request (speculative decoding) "
                         "are not supported yet")
    (a, b), (heads, head_dim, state_size) = spec.shapes
    conv_dim, window = (a, b) if conv_dim_first else (b, a)
    groups_local, rest = divmod(conv_dim - heads * head_dim, 2 * state_size)
    if rest or groups_local < 1:
        raise ValueError(f"a conv state of {conv_dim} channels is not {heads} x {head_dim} + 2 x groups x {state_size}")
    conv_dtype, ssm_dtype = (torch_dtype_name(d) for d in spec.dtypes)
    conv_bytes = window * conv_dim * spec.dtypes[0].itemsize
    if conv_bytes % spec.dtypes[1].itemsize:
        raise ValueError(f"the SSM state starts at byte {conv_bytes}, not a whole {ssm_dtype} element in")
    raw = [layer.view(torch.uint8) for layer in layers]
    if raw[0].dim() != 4 or raw[0].shape[1:3] != (1, 1) or raw[0].stride(3) != 1:
        raise ValueError(f"a Mamba layer is viewed as {tuple(raw[0].shape)}, expected (blocks, 1, 1, page bytes)")
    step = layer_step_bytes(raw)
    state = MambaSpec(raw[0].shape[0], num_heads=heads * tp_size, head_dim=head_dim,
                      num_groups=num_groups or groups_local * tp_size, state_size=state_size, conv_window=window,
                      conv_dtype=conv_dtype, ssm_dtype=ssm_dtype, conv_order="DW" if conv_dim_first else "WD",
                      page_bytes=spec.page_size_bytes, block_stride=raw[0].stride(0), num_layers=len(raw),
                      layer_stride=step or raw[0].stride(0), conv_parts=CONV_PARTS_BY_TYPE[mamba_type])
    region = state.region(tp_size, tp_rank)  # the rank's share must be what the views hold
    if region.field("ssm").layout.size("heads") != heads or region.field("conv_b").layout.size("groups") != groups_local:
        raise ValueError(f"rank {tp_rank} of {tp_size} would hold other heads or groups than its views "
                         f"({heads} heads, {groups_local} groups)")
    return StateGroup("mamba", tuple(layer_names), state)
