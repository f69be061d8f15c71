"""A sliding-window model through P/D on vLLM (CPU): prefill hands over only the blocks still in the window."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations.vllm_cluster import (BLOCK_SIZE, TINY_MISTRAL_SWA, changed, engine, greedy, hold_ends,
                                             record_events, prefill_params, prompts_of, shutdown, tiny_model_and_daemons)

# A second model kind on a real engine (about 70 s on 2 cores): with -m slow and -m vllm. The default
# run keeps the full-attention model of test_vllm_e2e; sliding-window groups are proven in the default
# run by the plan tests (tests/plan) and byte-exact over NIXL and the daemons (the demo's swa preset).
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WINDOW = TINY_MISTRAL_SWA["sliding_window"]


def test_sliding_window_prefill_decode_gives_the_single_instance_tokens(tmp_path):
    model, daemons = tiny_model_and_daemons(tmp_path, ["ws0", "ws1"], TINY_MISTRAL_SWA)
    recorder = record_events(daemons[0], "swa-prefill")
    engines = []
    try:
        engines = [engine(model, "swa-prefill", daemons[0].socket), engine(model, "swa-decode", daemons[1].socket)]
        prefill, decode = engines
        rng = np.random.default_rng(11)
        prompts = [rng.integers(3, 500, n).tolist() for n in (20, 64, 65, 130, 200, 300)]  # some past the window
        single = [list(o.outputs[0].token_ids) for o in prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False)]
        params = prefill_params(prefill, prompts)
        # Blocks that left the window are vLLM's null block on prefill: only the window's blocks are handed over.
        for prompt, p in zip(prompts, params):
            assert len(p["remote_block_ids"][0]) <= -(-WINDOW // BLOCK_SIZE) + 1, (len(prompt), p["remote_block_ids"])
        outputs = decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == single
        events = hold_ends(daemons[0], "swa-prefill")
        assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)
        # Negative control: the same prompts with another prompt set's windows (same lengths) change the tokens.
        others = [rng.integers(3, 500, len(p)).tolist() for p in prompts]
        assert decode.reset_prefix_cache()
        crossed = prefill_params(prefill, others)
        outputs = decode.generate(prompts_of(prompts), [greedy(8, p) for p in crossed], use_tqdm=False)
        differ = changed([list(o.outputs[0].token_ids) for o in outputs], single)
        assert sum(differ) >= len(prompts) - 1, differ
    finally:
        shutdown(*engines)
        for daemon in daemons:
            daemon.terminate()
        recorder.close()
