"""vLLM prefill/decode through kvxferd: the same greedy tokens as one instance, on a real vLLM (CPU).

Three vLLM engines share one tiny model (dummy weights, fixed seed): a
prefill instance (also the single-instance reference), a decode instance
with ``kv_load_failure_policy=fail`` and one with ``recompute``; each has
its own kvxferd daemon. Requests go prefill (one token) -> kv_transfer_params
-> decode, as a proxy would send them.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from kvxferd.client import DaemonProcess
from tests.integrations.vllm_cluster import (BLOCK_SIZE, TINY_LLAMA, engine, greedy, hold_events, metric, record_events,
                                             prefill_params, prompt_tokens_by_source, prompts_of, write_tiny_model)

pytestmark = pytest.mark.vllm
# Shorter than a block, around block edges, several blocks.
PROMPT_LENGTHS = (5, 31, 32, 33, 64, 100, 150, 257)
BLOCK_BYTES = (TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * BLOCK_SIZE * 2
               * TINY_LLAMA["head_dim"] * 2)  # K and V, bfloat16, every layer


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (scripts/bootstrap.sh --vllm)")
    work = tmp_path_factory.mktemp("vllm")
    model = write_tiny_model(work / "tiny-llama")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    daemons = DaemonProcess.start_many(["vp0", "vd0", "vd1"], socket_dir=str(work))
    cluster = types.SimpleNamespace()
    try:
        vars(cluster).update(prefill_daemon=daemons[0], decode_daemon=daemons[1], recompute_daemon=daemons[2],
                             model=model)
        recorder = record_events(daemons[0], "prefill")
        cluster.prefill = engine(model, "prefill", daemons[0].socket)
        cluster.decode_recompute = engine(model, "decode-recompute", daemons[2].socket, policy="recompute")
        # vLLM's Prometheus counters are process-global: the engine built last owns them,
        # and the prompt-token counters checked below must be the decode instance's.
        cluster.decode = engine(model, "decode", daemons[1].socket, policy="fail")
        yield cluster
    finally:
        for name in ("prefill", "decode_recompute", "decode"):
            if name in vars(cluster):
                getattr(cluster, name).llm_engine.engine_core.shutdown()
        for daemon in daemons:
            daemon.terminate()
        if "recorder" in locals():
            recorder.close()


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def random_prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_LLAMA["vocab_size"], n).tolist() for n in lengths]


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def released_early(params: dict) -> dict:
    """Params naming a hold that no longer exists on prefill, as if its blocks were freed before decode read them.

    (Only the prefill engine, which holds its session, may really release its hold.)
    """
    return {**params, "remote_request_id": params["remote_request_id"] + "-freed"}


def test_prefill_decode_gives_the_single_instance_tokens(pd):
    prompts = random_prompts(1)
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    assert all(p and p.get("remote_block_ids") for p in params), params
    read_before = metric(pd.decode_daemon, "kvxferd_read_bytes_total")
    sources_before = prompt_tokens_by_source(pd.decode)
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(prompts)
    # Decode computed no prompt token itself: vLLM books the whole prompt as transferred (the
    # last token, re-run only to sample from it, is counted with the load).
    sources = {k: v - sources_before.get(k, 0) for k, v in prompt_tokens_by_source(pd.decode).items()}
    assert sources == {"local_compute": 0, "local_cache_hit": 0,
                       "external_kv_transfer": sum(len(p) for p in prompts)}, sources
    read = metric(pd.decode_daemon, "kvxferd_read_bytes_total") - read_before
    assert read == sum(blocks(len(p)) for p in prompts) * BLOCK_BYTES
    # Every prefill hold ended exactly once, CONSUMED, and none is left.
    events = hold_events(pd.prefill_daemon, "prefill")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)
    assert metric(pd.prefill_daemon, "kvxferd_holds_pending") == 0


def test_a_decode_prefix_hit_reads_only_the_uncached_tail(pd):
    first = random_prompts(2, (100,))[0]
    pd.decode.generate(prompts_of([first]), [greedy(2, prefill_params(pd.prefill, [first])[0])], use_tqdm=False)
    second = first[:96] + random_prompts(3, (60,))[0]  # shares 3 full blocks with the first
    single = token_ids(pd.prefill.generate(prompts_of([second]), greedy(8), use_tqdm=False))
    (params,) = prefill_params(pd.prefill, [second])
    read_before = metric(pd.decode_daemon, "kvxferd_read_bytes_total")
    outputs = pd.decode.generate(prompts_of([second]), [greedy(8, params)], use_tqdm=False)
    assert token_ids(outputs) == single
    assert metric(pd.decode_daemon, "kvxferd_read_bytes_total") - read_before == (blocks(156) - 3) * BLOCK_BYTES
    assert hold_events(pd.prefill_daemon, "prefill")[params["remote_request_id"]] == ["CONSUMED"]


def test_a_failed_read_fails_that_request_under_fail_and_the_engines_keep_serving(pd):
    prompts = random_prompts(4, (70, 40))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(6), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    params[0] = released_early(params[0])  # the blocks are freed before decode reads them
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert token_ids(outputs)[1] == single[1] and outputs[1].outputs[0].finish_reason == "length"
    # ... and the next request is served as if nothing happened.
    again = random_prompts(5, (90,))
    expected = token_ids(pd.prefill.generate(prompts_of(again), greedy(6), use_tqdm=False))
    result = pd.decode.generate(prompts_of(again), [greedy(6, prefill_params(pd.prefill, again)[0])], use_tqdm=False)
    assert token_ids(result) == expected


def test_a_failed_read_is_recomputed_under_recompute_with_the_same_tokens(pd):
    prompts = random_prompts(6, (130, 45))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(6), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    params[0] = released_early(params[0])
    failures_before = metric(pd.recompute_daemon, 'kvxferd_read_failures_total{kind="stale"}')
    outputs = pd.decode_recompute.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert metric(pd.recompute_daemon, 'kvxferd_read_failures_total{kind="stale"}') == failures_before + 1


@pytest.mark.parametrize("damage", ["missing", "unknown_engine", "out_of_range", "bad_address", "prefill_error"])
def test_bad_kv_transfer_params_fail_that_request_only(pd, damage):
    prompts = random_prompts(7, (50, 60))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(4), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    bad = dict(params[0])
    if damage == "missing":
        del bad["remote_block_ids"]
    elif damage == "unknown_engine":
        bad["remote_engine_id"] = "nobody"
    elif damage == "out_of_range":
        bad["remote_block_ids"] = [[10**6, 10**6 + 1]]
    elif damage == "bad_address":
        bad["remote_engine_id"], bad["remote_peer_addresses"] = "elsewhere", ["127.0.0.1:1"]
    else:
        bad = {"do_remote_prefill": True, "kvxferd": 1, "error": "the prefill daemon was down"}
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(4, bad), greedy(4, params[1])], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert token_ids(outputs)[1] == single[1]


def test_prefill_tp2_to_decode_tp1(pd, tmp_path):
    """Two prefill ranks (each with its own daemon) hold, one decode rank reads half the heads from each.

    vLLM's CPU build binds each TP worker to a NUMA node unless told which cores
    to use; this machine has one node, so each worker gets one core.
    """
    daemons = DaemonProcess.start_many(["vt0", "vt1"], socket_dir=str(tmp_path))
    recorders = [record_events(daemon, "prefill-tp2") for daemon in daemons]
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        prefill = engine(pd.model, "prefill-tp2", str(tmp_path / "vt{rank}.sock"), tp_size=2)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND") if previous is None else os.environ.update(
            VLLM_CPU_OMP_THREADS_BIND=previous)
    try:
        prompts = random_prompts(8, (20, 70, 150))
        single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(6), use_tqdm=False))
        params = prefill_params(prefill, prompts)
        assert [len(p["remote_peer_addresses"]) for p in params] == [2, 2, 2]
        outputs = pd.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
        assert token_ids(outputs) == single
        for daemon in daemons:  # both prefill ranks' holds were consumed
            events = hold_events(daemon, "prefill-tp2")
            assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * 3
    finally:
        prefill.llm_engine.engine_core.shutdown()
        for daemon in daemons:
            daemon.terminate()
        for recorder in recorders:
            recorder.close()
