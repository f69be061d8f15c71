"""Push on a real vLLM (CPU, issue #57): both legs at once, the prefill daemon writes into decode's blocks.

A prefill and a decode engine whose connectors run ``mode: push``, each with its own daemon (over NIXL).
Each request's two legs are dispatched together under one transfer id, as the proxy does in push mode:
decode (in a thread) expects its blocks, prefill computes and holds under the transfer id, its daemon
writes. The tokens must be the single instance's; the negative control pushes another prompt's KV
and the tokens change; a push nobody fills fails the request under ``fail``. Select with
``scripts/test.sh -m vllm -k push``.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import pytest

from kvxferd.plan.capability import PUSH_KEY_BYTES, push_key_digest
from tests.integrations.vllm_cluster import (BLOCK_BYTES, changed, greedy, hold_ends, metric, prefill_decode,
                                             prefill_params, prompts_of, random_prompts, tiny_model_and_daemons, token_ids)
from tests.integrations.vllm_stats_check import connector_metrics

pytestmark = pytest.mark.vllm
LAYER_MIN_TOKENS = 64


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    model, daemons = tiny_model_and_daemons(tmp_path_factory.mktemp("vllm-push"), ["pp0", "pd0"])
    # Prompts of 64 tokens and more are written layer by layer (the others in one batch after the forward pass).
    extra = {"mode": "push", "deadline_s": 6.0, "push_layer_min_tokens": LAYER_MIN_TOKENS}
    with prefill_decode(model, daemons, "prefill", "decode", extra=extra) as cluster:
        # What a proxy learns from a first answer: where the prefill engine is (a pull still works in push mode).
        (params,) = prefill_params(cluster.prefill, [[5, 6, 7, 8]])
        cluster.where = {"remote_engine_id": params["remote_engine_id"],
                         "remote_peer_addresses": params["remote_peer_addresses"]}
        cluster.decode.generate(prompts_of([[5, 6, 7, 8]]), [greedy(1, params)], use_tqdm=False)  # read: it ends
        yield cluster


def push_key(transfer_id: str) -> bytes:
    """A transfer's push key (made from its id here; the proxy makes a random one)."""
    return hashlib.blake2b(transfer_id.encode(), digest_size=PUSH_KEY_BYTES).digest()


def push_params(pd, transfer_id: str) -> dict:
    return {"do_remote_prefill": True, "kvxferd": 1, "kvxferd_push": True, "transfer_id": transfer_id,
            "push_key": push_key(transfer_id).hex(), **pd.where}


def prefill_leg(transfer_id: str) -> dict:
    return {"do_remote_decode": True, "kvxferd_transfer_id": transfer_id,
            "kvxferd_push_digest": push_key_digest(push_key(transfer_id)).hex()}


def push(pd, decode_prompts, prefill_prompts, transfer_ids, max_tokens: int = 8, *, prefill_ids=None):
    """Both legs at once: decode (a thread) expects ``transfer_ids``, prefill runs ``prefill_prompts`` under
    ``prefill_ids`` (default the same ids). The decode outputs."""
    outputs = {}

    def decode():
        outputs["decode"] = pd.decode.generate(prompts_of(decode_prompts),
                                               [greedy(max_tokens, push_params(pd, t)) for t in transfer_ids],
                                               use_tqdm=False)

    leg = threading.Thread(target=decode)
    leg.start()
    time.sleep(0.2)  # the decode leg is in: its expectations go out while prefill computes
    pd.prefill.generate(prompts_of(prefill_prompts),
                        [greedy(1, prefill_leg(t)) for t in (prefill_ids or transfer_ids)], use_tqdm=False)
    leg.join(timeout=120)
    assert not leg.is_alive(), "the decode leg did not finish"
    return outputs["decode"]


def test_push_gives_the_single_instance_tokens(pd):
    prompts = random_prompts(31)
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    ids = [f"push-{uuid.uuid4().hex[:12]}" for _ in prompts]
    written_before = metric(pd.prefill_daemon, "kvxferd_push_bytes_total")
    stages_before = metric(pd.prefill_daemon, "kvxferd_push_stages_total")
    stats_before = connector_metrics(pd.decode)
    outputs = push(pd, prompts, prompts, ids)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(prompts)
    assert token_ids(outputs) == single
    assert metric(pd.prefill_daemon, "kvxferd_push_bytes_total") > written_before  # written, not read
    # the long prompts layer by layer: at least a stage per layer of the tiny model (2) and a last one each
    layered = sum(len(p) >= LAYER_MIN_TOKENS for p in prompts)
    assert layered and metric(pd.prefill_daemon, "kvxferd_push_stages_total") - stages_before >= 2 * layered
    stats = {k: v - stats_before.get(k, 0) for k, v in connector_metrics(pd.decode).items()}
    assert (stats["vllm:kvxferd_num_transfers"], stats["vllm:kvxferd_num_failed_transfers"]) == (len(prompts), 0)
    # Every prefill hold (by its transfer id) ended exactly once, CONSUMED, and none is left.
    deadline = time.monotonic() + 10
    while metric(pd.prefill_daemon, "kvxferd_holds_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    events = hold_ends(pd.prefill_daemon, "prefill")
    assert [events.get(t) for t in ids] == [["CONSUMED"]] * len(prompts)
    assert metric(pd.prefill_daemon, "kvxferd_holds_pending") == 0


def test_push_of_another_prompts_kv_changes_the_tokens(pd):
    """Negative control: each transfer id's prefill leg computes another prompt of the same length, so the
    daemons push real KV of the wrong prompt into the expected blocks: the tokens must change."""
    first, second = random_prompts(32), random_prompts(33)
    single = token_ids(pd.prefill.generate(prompts_of(first), greedy(8), use_tqdm=False))
    ids = [f"cross-{uuid.uuid4().hex[:12]}" for _ in first]
    outputs = push(pd, first, second, ids)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(first)
    assert sum(changed(token_ids(outputs), single)) >= len(first) - 1, (token_ids(outputs), single)


def test_a_push_nobody_fills_fails_that_request_under_fail_and_the_others_are_served(pd):
    """The prefill leg of one request never comes (its transfer id is never held): decode's expectation
    fails at the connector's deadline and vLLM fails that request (``fail``); the other request, pushed
    in the same batch, gets the single instance's tokens."""
    prompts = random_prompts(34, (70, 40))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(6), use_tqdm=False))
    ids = [f"lost-{uuid.uuid4().hex[:12]}", f"kept-{uuid.uuid4().hex[:12]}"]
    start = time.monotonic()
    outputs = push(pd, prompts, prompts[1:], ids, max_tokens=6, prefill_ids=ids[1:])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert time.monotonic() - start >= 6.0  # its deadline, not before
    assert token_ids(outputs)[1] == single[1] and outputs[1].outputs[0].finish_reason == "length"


def test_a_push_with_a_decode_prefix_hit_writes_only_the_uncached_tail(pd):
    """Decode holds the first 3 blocks of the prompt already (its prefix cache, from an earlier push of a
    prompt that starts alike): its expectation names only the 2 blocks after them, the prefill daemon
    writes exactly those (layer by layer: 156 tokens), and the tokens are the single instance's."""
    first = random_prompts(35, (100,))[0]
    push(pd, [first], [first], [f"first-{uuid.uuid4().hex[:12]}"], max_tokens=2)
    second = first[:96] + random_prompts(36, (60,))[0]  # shares 3 full blocks of 32 tokens with the first
    single = token_ids(pd.prefill.generate(prompts_of([second]), greedy(8), use_tqdm=False))
    written_before = metric(pd.prefill_daemon, "kvxferd_push_bytes_total")
    outputs = push(pd, [second], [second], [f"tail-{uuid.uuid4().hex[:12]}"])
    assert token_ids(outputs) == single
    assert metric(pd.prefill_daemon, "kvxferd_push_bytes_total") - written_before == (5 - 3) * BLOCK_BYTES
