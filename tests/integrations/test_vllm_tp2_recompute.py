"""vLLM through kvxferd with prefill TP=2, and a failed read recomputed under ``recompute``, on a real vLLM (CPU).

Two vLLM engines with the tiny model of ``test_vllm_e2e.py``: a prefill
instance at TP=2 (two ranks, each with its own kvxferd daemon) and a decode
instance at TP=1 with ``kv_load_failure_policy=recompute`` and its own daemon.
The decode instance is also the single-instance reference: it generates
each prompt alone first, then forgets its prefix cache, so the P/D request
that follows reads (or recomputes) every block.

These engines are their own (not ``test_vllm_e2e.py``'s) so that the two
files, each a few engine start-ups long, run side by side.
"""

from __future__ import annotations

import os
import types

import pytest

from tests.integrations.vllm_cluster import (engine, greedy, hold_events, metric, prefill_params, prompts_of,
                                             random_prompts, record_events, released_early, shutdown,
                                             tiny_model_and_daemons, token_ids)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-tp2")
    model, daemons = tiny_model_and_daemons(work, ["vt0", "vt1", "vr0"])
    cluster = types.SimpleNamespace(prefill_daemons=daemons[:2], recompute_daemon=daemons[2])
    recorders = []
    try:
        recorders = [record_events(daemon, "prefill-tp2") for daemon in daemons[:2]]
        # vLLM's CPU build binds each TP worker to a NUMA node unless told which cores
        # to use; this machine has one node, so each worker gets one core.
        previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        try:
            cluster.prefill = engine(model, "prefill-tp2", str(work / "vt{rank}.sock"), tp_size=2)
        finally:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND") if previous is None else os.environ.update(
                VLLM_CPU_OMP_THREADS_BIND=previous)
        cluster.decode = engine(model, "decode-recompute", daemons[2].socket, policy="recompute")
        yield cluster
    finally:
        shutdown(*(getattr(cluster, name) for name in ("prefill", "decode") if name in vars(cluster)))
        for daemon in daemons:
            daemon.terminate()
        for recorder in recorders:
            recorder.close()


def single_instance(llm, prompts, max_tokens: int) -> list[list[int]]:
    """``llm``'s own greedy tokens for ``prompts``; then its prefix cache is emptied (the next read covers every block)."""
    tokens = token_ids(llm.generate(prompts_of(prompts), greedy(max_tokens), use_tqdm=False))
    assert llm.reset_prefix_cache()
    return tokens


def test_prefill_tp2_to_decode_tp1(tp2):
    """Two prefill ranks (each with its own daemon) hold, one decode rank reads half the heads from each."""
    prompts = random_prompts(8, (20, 70, 150))
    single = single_instance(tp2.decode, prompts, 6)
    params = prefill_params(tp2.prefill, prompts)
    assert [len(p["remote_peer_addresses"]) for p in params] == [2, 2, 2]
    outputs = tp2.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    for daemon in tp2.prefill_daemons:  # both prefill ranks' holds were consumed
        events = hold_events(daemon, "prefill-tp2")
        assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * 3, _post_mortem(tp2)


def _post_mortem(tp2) -> str:
    """What the daemons counted and logged (a failed read is recomputed here, so tokens do not show it)."""
    import urllib.request
    lines = []
    for daemon in (*tp2.prefill_daemons, tp2.recompute_daemon):
        text = urllib.request.urlopen(daemon.addresses["metrics"], timeout=5).read().decode()
        lines += [f"{daemon.daemon_id}: {line}" for line in text.splitlines()
                  if line.startswith(("kvxferd_read_failures_total", "kvxferd_holds_pending", "kvxferd_stale",
                                      "kvxferd_notices", "kvxferd_late", "kvxferd_read_bytes_total"))]
        lines += [line for line in daemon.tail(30000).splitlines() if '"DEBUG"' not in line][-15:]
    return "\n".join(lines)


def test_a_failed_read_is_recomputed_under_recompute_with_the_same_tokens(tp2):
    prompts = random_prompts(6, (130, 45))
    single = single_instance(tp2.decode, prompts, 6)
    params = prefill_params(tp2.prefill, prompts)
    params[0] = released_early(params[0])
    failures_before = metric(tp2.recompute_daemon, 'kvxferd_read_failures_total{kind="stale"}')
    outputs = tp2.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert metric(tp2.recompute_daemon, 'kvxferd_read_failures_total{kind="stale"}') == failures_before + 1
