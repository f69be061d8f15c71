"""vLLM prefill/decode through kvxferd: the same greedy tokens as one instance, on a real vLLM (CPU).

Two vLLM engines share one tiny model (dummy weights, fixed seed): a
prefill instance (also the single-instance reference) and a decode instance
with ``kv_load_failure_policy=fail``; each has its own kvxferd daemon.
Requests go prefill (one token) -> kv_transfer_params -> decode, as a proxy
would send them. ``test_vllm_tp2_recompute.py`` has TP=2 prefill and the
``recompute`` policy (its own engines: the two files run side by side).
"""

from __future__ import annotations

import os
import time
import types

import pytest

from kvxferd.client import DaemonProcess

from tests.integrations.vllm_cluster import (BLOCK_SIZE, TINY_LLAMA, engine, greedy, hold_events, metric, prefill_params,
                                             prompt_tokens_by_source, prompts_of, random_prompts, record_events,
                                             released_early, shutdown, tiny_model_and_daemons, token_ids)

pytestmark = pytest.mark.vllm
BLOCK_BYTES = (TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * BLOCK_SIZE * 2
               * TINY_LLAMA["head_dim"] * 2)  # K and V, bfloat16, every layer


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    model, daemons = tiny_model_and_daemons(tmp_path_factory.mktemp("vllm"), ["vp0", "vd0"])
    cluster = types.SimpleNamespace()
    try:
        vars(cluster).update(prefill_daemon=daemons[0], decode_daemon=daemons[1], model=model, daemons=daemons)
        recorder = record_events(daemons[0], "prefill")
        cluster.prefill = engine(model, "prefill", daemons[0].socket)
        # vLLM's Prometheus counters are process-global: the engine built last owns them,
        # and the prompt-token counters checked below must be the decode instance's.
        cluster.decode = engine(model, "decode", daemons[1].socket, policy="fail")
        yield cluster
    finally:
        shutdown(*(getattr(cluster, name) for name in ("prefill", "decode") if name in vars(cluster)))
        for daemon in daemons:
            daemon.terminate()
        if "recorder" in locals():
            recorder.close()


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


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


def test_both_daemons_restart_under_running_engines_and_pd_goes_on(pd):
    """kill -9 of both daemons, restarted at the same sockets and peer ports: each engine's worker
    registers its cache again by itself (fds passed anew, its session kept), and P/D gives the
    single-instance tokens again, with no engine restarted. (Runs last: the bus recorder of the
    fixture does not follow the restarted prefill daemon.)"""
    prompts = random_prompts(11, (70, 40))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    for index, old in enumerate(pd.daemons):
        old.kill()
        pd.daemons[index] = DaemonProcess(old.daemon_id, socket_dir=os.path.dirname(old.socket),
                                          extra_args=old.port_args(("peer",)))
    pd.prefill_daemon, pd.decode_daemon = pd.daemons
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(metric(d, "kvxferd_engines_registered") == 1 for d in pd.daemons):
        time.sleep(0.2)
    assert [metric(d, "kvxferd_engines_registered") for d in pd.daemons] == [1, 1]
    params = prefill_params(pd.prefill, prompts)
    assert all(p and p.get("remote_block_ids") for p in params), params  # holds work: the session was kept
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    assert metric(pd.decode_daemon, "kvxferd_read_bytes_total") == sum(blocks(len(p)) for p in prompts) * BLOCK_BYTES
    # The reads' notices end the holds a little after the engine has its blocks (the holder's next poll;
    # on a loaded machine that can be after generate returns): they must end, within seconds.
    deadline = time.monotonic() + 10
    while metric(pd.prefill_daemon, "kvxferd_holds_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(pd.prefill_daemon, "kvxferd_holds_pending") == 0
