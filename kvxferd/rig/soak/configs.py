"""Random pairings for the soak: model kind, TP sizes, heads, block sizes, prefix hits.

A draw the daemons would refuse (heads that do not split, block sizes that
do not pair) is drawn again; the refusals are counted, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.rig.verify.buffers import check_pairing
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups, random_request

MAX_TP = 4
KV_HEADS = (1, 2, 3, 4, 6, 8)
BLOCK_SIZES = (8, 16, 32)


@dataclass(frozen=True)
class SoakConfig:
    """One pairing the soak runs requests through."""

    model: str
    prefill_tp: int
    decode_tp: int
    shape: ModelShape
    num_tokens: int
    cached_tokens: int

    def describe(self) -> str:
        s = self.shape
        return (f"{self.model} P{self.prefill_tp}->D{self.decode_tp} heads={s.num_kv_heads} layout={s.layout} "
                f"blocks {s.prefill_block_size}->{s.decode_block_size}"
                f"{f'/{s.kernel_block_size}' if s.kernel_block_size else ''} tokens={self.num_tokens}"
                f"{f' cached={self.cached_tokens}' if self.cached_tokens else ''}")

    def groups(self):
        return model_groups(self.model, self.shape)

    def request(self, request_id: str, rng: np.random.Generator):
        prefill_groups, decode_groups = self.groups()
        cached = self.cached_tokens if rng.random() < 0.5 else 0
        return random_request(request_id, prefill_groups, decode_groups, self.num_tokens, rng, cached_tokens=cached,
                              window_tokens=32, contiguous=bool(rng.random() < 0.6))


def _candidate(rng: np.random.Generator, max_tp: int) -> SoakConfig:
    model = str(rng.choice(MODELS))
    prefill_bs, decode_bs = (int(rng.choice(BLOCK_SIZES)) for _ in range(2))
    kernel = None
    if model != "mla" and decode_bs >= 16 and rng.random() < 0.3:
        kernel = decode_bs // 2  # the decode kernel splits each block in two
    shape = ModelShape(num_layers=int(rng.integers(1, 3)), num_kv_heads=int(rng.choice(KV_HEADS)), head_size=32,
                       block_size=decode_bs, prefill_block_size=prefill_bs, decode_block_size=decode_bs,
                       kernel_block_size=kernel, num_blocks=48,
                       layout="nhd" if model in ("gqa", "swa", "hybrid") and rng.random() < 0.3 else "packed")
    num_tokens = int(rng.integers(1, 6 * max(prefill_bs, decode_bs)))
    cached = decode_bs * int(rng.integers(0, 3)) if num_tokens > 3 * decode_bs else 0
    return SoakConfig(model, int(rng.integers(1, max_tp + 1)), int(rng.integers(1, max_tp + 1)), shape,
                      num_tokens, cached)


def check_config(config: SoakConfig) -> None:
    """Raise what the daemons would answer if this pairing cannot be planned."""
    prefill_groups, decode_groups = config.groups()
    check_pairing(prefill_groups, decode_groups, config.prefill_tp, config.decode_tp)
    random_request("check", prefill_groups, decode_groups, config.num_tokens, np.random.default_rng(0),
                   cached_tokens=config.cached_tokens, window_tokens=32)


def draw_config(rng: np.random.Generator, max_tp: int = MAX_TP, max_tries: int = 200) -> tuple[SoakConfig, int]:
    """A pairing (TP sizes up to ``max_tp``) the daemons accept, and how many draws were refused before it."""
    for refused in range(max_tries):
        config = _candidate(rng, max_tp)
        try:
            check_config(config)
            return config, refused
        except (KvxferError, ValueError):
            continue
    raise RuntimeError(f"no valid pairing in {max_tries} draws")
