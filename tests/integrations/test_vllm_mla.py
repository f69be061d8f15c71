"""MLA through kvxferd on a real vLLM (CPU): a DeepSeek-V2 whose cache holds one latent per token.

vLLM's CPU build runs multi-head latent attention (its CPU_MLA backend); the
connector describes the cache as ``strided`` with ``latent`` content (no
heads, the same on every TP rank). Prefill and decode are TP 1 in the default
run; ``-m slow`` adds prefill TP 2 -> decode TP 1 (read one rank, notify both).
The negative control decodes with another request's KV and must change the
tokens.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm_cluster import (changed, engine, hold_ends, metric, one_by_one, one_core_per_worker,
                                             prefill_decode, prefill_params, random_prompts, record_events, shutdown,
                                             tiny_model_and_daemons)

pytestmark = pytest.mark.vllm
LENGTHS = (7, 16, 33, 100)
LATENT_BLOCK_BYTES = 2 * 16 * 576 * 4  # 2 layers, 16 tokens, 576 float32 elements


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    from kvxferd.rig.vllm.tinymodel import write_tiny_mla_model

    model, daemons = tiny_model_and_daemons(tmp_path_factory.mktemp("mla"), ["mlp0", "mld0"], write=write_tiny_mla_model)
    with prefill_decode(model, daemons, "mla-prefill", "mla-decode", dtype="float32") as cluster:
        yield cluster


def test_mla_prefill_decode_gives_the_single_instance_tokens(mla):
    prompts = random_prompts(31, LENGTHS)
    single = one_by_one(mla.prefill, prompts)
    assert one_by_one(mla.prefill, prompts) == single  # the reference repeats itself
    params = [prefill_params(mla.prefill, [p])[0] for p in prompts]
    assert all(p and p.get("remote_block_ids") for p in params), params
    read_before = metric(mla.decode_daemon, "kvxferd_read_bytes_total")
    assert one_by_one(mla.decode, prompts, params) == single
    read = metric(mla.decode_daemon, "kvxferd_read_bytes_total") - read_before
    assert read == sum(-(-len(p) // 16) for p in prompts) * LATENT_BLOCK_BYTES  # the latents, nothing more
    events = hold_ends(mla.prefill_daemon, "mla-prefill")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)


def test_mla_another_requests_latents_change_the_tokens(mla):
    """Negative control: prompts of the same lengths decoded with each other's latents."""
    first, second = random_prompts(41, LENGTHS), random_prompts(42, LENGTHS)
    single = one_by_one(mla.prefill, first + second)
    params = [prefill_params(mla.prefill, [p])[0] for p in first + second]
    crossed = params[len(first):] + params[:len(first)]
    tokens = one_by_one(mla.decode, first + second, crossed)
    assert sum(changed(tokens, single)) >= len(tokens) - 1, (tokens, single)


@pytest.mark.slow
def test_mla_prefill_tp2_to_decode_tp1_reads_one_rank_and_ends_both_holds(tmp_path):
    """Read one, notify all: both prefill ranks hold the same latents; decode reads them from one and
    both holds end CONSUMED. Tokens: decode TP 1 alone is the reference (TP 2 rounds otherwise)."""
    from kvxferd.rig.vllm.tinymodel import write_tiny_mla_model

    model, daemons = tiny_model_and_daemons(tmp_path, ["mt0", "mt1", "mtd"], write=write_tiny_mla_model)
    recorders, llms = [record_events(d, "mla-tp2") for d in daemons[:2]], []
    try:
        with one_core_per_worker():
            llms.append(engine(model, "mla-tp2", str(tmp_path / "mt{rank}.sock"), tp_size=2, dtype="float32"))
        llms.append(engine(model, "mla-d1", daemons[2].socket, dtype="float32"))
        prefill, decode = llms
        prompts = random_prompts(51, LENGTHS)
        single = one_by_one(decode, prompts)
        params = [prefill_params(prefill, [p])[0] for p in prompts]
        assert [len(p["remote_peer_addresses"]) for p in params] == [2] * len(prompts)
        read_before = [metric(d, "kvxferd_read_bytes_total") for d in daemons]
        assert one_by_one(decode, prompts, params) == single
        read = metric(daemons[2], "kvxferd_read_bytes_total") - read_before[2]
        assert read == sum(-(-len(p) // 16) for p in prompts) * LATENT_BLOCK_BYTES  # each latent once
        for daemon in daemons[:2]:
            events = hold_ends(daemon, "mla-tp2")
            assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)
    finally:
        shutdown(*llms)
        for daemon in daemons:
            daemon.terminate()
        for recorder in recorders:
            recorder.close()
