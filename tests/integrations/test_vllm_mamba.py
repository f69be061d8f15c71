"""Mamba2 through kvxferd on a real vLLM (CPU): a tiny Mamba2 whose whole context is one state page.

vLLM's CPU build runs Mamba2 (its cpu SSU backend). A request's cache is then
one page per layer: the conv state and the SSM state after the prompt. A
running state cannot take the last prompt token twice, so the prefiller stops
one token short and decode computes it (scheduler.py). The negative control
decodes with another prompt's states and must change the tokens.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm_cluster import (changed, hold_ends, metric, one_by_one, prefill_decode, prefill_params,
                                             prompt_tokens_by_source, random_prompts, tiny_model_and_daemons)

pytestmark = pytest.mark.vllm
LENGTHS = (1, 7, 16, 33, 100)
MAMBA2 = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_heads=8, head_dim=32, expand=1, n_groups=1,
              state_size=16, conv_kernel=4, chunk_size=64)
# What one request's states are, per layer: conv (kernel - 1 columns of x|B|C) and SSM (heads x head_dim x state).
CONV_CHANNELS = MAMBA2["num_heads"] * MAMBA2["head_dim"] + 2 * MAMBA2["n_groups"] * MAMBA2["state_size"]
STATE_BYTES = 4 * MAMBA2["num_hidden_layers"] * ((MAMBA2["conv_kernel"] - 1) * CONV_CHANNELS
                                                 + MAMBA2["num_heads"] * MAMBA2["head_dim"] * MAMBA2["state_size"])


def write_tiny_mamba2(directory) -> str:
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(**MAMBA2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          torch_dtype="float32")
    torch.manual_seed(0)
    Mamba2ForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    model, daemons = tiny_model_and_daemons(tmp_path_factory.mktemp("mamba2"), ["m2p", "m2d"], write=write_tiny_mamba2)
    with prefill_decode(model, daemons, "mamba-prefill", "mamba-decode", dtype="float32") as cluster:
        yield cluster


def test_mamba2_prefill_decode_gives_the_single_instance_tokens(mamba):
    prompts = random_prompts(61, LENGTHS)
    single = one_by_one(mamba.prefill, prompts)
    params = [prefill_params(mamba.prefill, [p])[0] for p in prompts]
    # prefill stopped one token short: decode loads the state after N - 1 tokens (a 1-token prompt: nothing)
    assert [p["remote_num_tokens"] for p in params] == [max(len(p) - 1, 1) for p in prompts]
    sources_before = prompt_tokens_by_source(mamba.decode)
    read_before = metric(mamba.decode_daemon, "kvxferd_read_bytes_total")
    assert one_by_one(mamba.decode, prompts, params) == single
    read = metric(mamba.decode_daemon, "kvxferd_read_bytes_total") - read_before
    assert read == STATE_BYTES * sum(len(p) > 1 for p in prompts)  # each state once, its padding not at all
    sources = prompt_tokens_by_source(mamba.decode)
    assert sources.get("external_kv_transfer", 0) - sources_before.get("external_kv_transfer", 0) == \
        sum(len(p) - 1 for p in prompts)
    events = hold_ends(mamba.prefill_daemon, "mamba-prefill")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)


def test_mamba2_another_prompts_states_change_the_tokens(mamba):
    """Negative control: prompts of the same lengths decoded with each other's states."""
    first, second = random_prompts(71, LENGTHS[1:]), random_prompts(72, LENGTHS[1:])
    single = one_by_one(mamba.prefill, first + second)
    params = [prefill_params(mamba.prefill, [p])[0] for p in first + second]
    crossed = params[len(first):] + params[:len(first)]
    tokens = one_by_one(mamba.decode, first + second, crossed)
    assert all(changed(tokens, single)), (tokens, single)
