"""vLLM through kvxferd across TP sizes and block sizes, and the ``recompute`` policy, on a real vLLM (CPU).

Three vLLM engines with the KV-sensitive tiny model (4 KV heads), each rank
with its own kvxferd daemon::

    prefill-tp2  (TP 2, blocks of 64)  ──►  decode-recompute (TP 1, blocks of 32, recompute)
    decode-recompute as a prefill      ──►  decode-tp2       (TP 2, blocks of 64)

TP 2 -> 1 reads two heads from each prefill rank, each prefill block into
two decode blocks; TP 1 -> 2 has each decode rank read its two heads out of
one prefill rank, two prefill blocks into one of its own. vLLM's CPU
kernels keep K transposed per head (``kv_per_head_kt``), so a block split
into the other side's tokens is many short runs: the layout, not only the
block ids, must be right.
A negative control with the prefill's heads reversed shows the TP 1 -> 2
tokens depend on every head landing on the right rank. Each decode engine is
also its own single-instance reference: it generates each prompt alone first,
then forgets its prefix cache, so the P/D request that follows reads (or
recomputes) every block.

These engines are their own (not ``test_vllm_e2e.py``'s) so that the two
files, each a few engine start-ups long, run side by side.
"""

from __future__ import annotations

import types

import pytest

from tests.integrations.connector_pair import eventually
from tests.integrations.vllm_cluster import (_RECORDERS, changed, damage_blocks, engine, greedy, hold_ends,
                                             hold_events, metric, one_core_per_worker, prefill_params, prompts_of,
                                             random_prompts, record_events, released_early, shutdown,
                                             tiny_model_and_daemons, token_ids, wait_for_reset)

pytestmark = pytest.mark.vllm
# float32 here: TP 1 and TP 2 sum a layer's partial products in another order, and in bfloat16 that
# rounding alone flips near-tied greedy tokens of this random model after a few steps.
DTYPE = "float32"
BLOCK_BYTES = 2 * 4 * 32 * 2 * 64 * 4  # a prefill block of 32 tokens: 2 layers x 4 KV heads x K and V, float32


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-tp2")
    model, daemons = tiny_model_and_daemons(work, ["vt0", "vt1", "vr0", "vw0", "vw1"])
    cluster = types.SimpleNamespace(prefill_daemons=daemons[:2], recompute_daemon=daemons[2],
                                    decode_tp2_daemons=daemons[3:])
    recorders = []
    try:
        recorders = [record_events(daemon, "prefill-tp2") for daemon in daemons[:2]]
        recorders.append(record_events(daemons[2], "decode-recompute"))
        with one_core_per_worker():
            # Holds live 60 s (not 20): on a loaded CI machine a daemon stalled 10 s and decode's recompute of
            # eight prompts came to two of their reads after 20 s, which found those holds EXPIRED.
            cluster.prefill = engine(model, "prefill-tp2", str(work / "vt{rank}.sock"), tp_size=2, block_size=64,
                                     dtype=DTYPE, lease_s=60.0)
            cluster.decode_tp2 = engine(model, "decode-tp2", str(work / "vw{rank}.sock"), tp_size=2, block_size=64,
                                      dtype=DTYPE)
        cluster.decode = engine(model, "decode-recompute", daemons[2].socket, policy="recompute", dtype=DTYPE)
        yield cluster
    finally:
        shutdown(*(getattr(cluster, name) for name in ("prefill", "decode", "decode_tp2") if name in vars(cluster)))
        for daemon in daemons:
            daemon.terminate()
        for recorder in recorders:
            recorder.close()


def single_instance(llm, prompts, max_tokens: int) -> list[list[int]]:
    """``llm``'s own greedy tokens for ``prompts``; then its prefix cache is emptied (the next read covers every block)."""
    tokens = token_ids(llm.generate(prompts_of(prompts), greedy(max_tokens), use_tqdm=False))
    assert llm.reset_prefix_cache()
    return tokens


def test_prefill_tp2_to_decode_tp1_with_shorter_decode_blocks(tp2):
    """Two prefill ranks (blocks of 64, each with its own daemon) hold; one decode rank (blocks of 32)
    reads half the heads from each."""
    prompts = random_prompts(8)
    single = single_instance(tp2.decode, prompts, 6)
    params = prefill_params(tp2.prefill, prompts)
    assert [len(p["remote_peer_addresses"]) for p in params] == [2] * len(prompts)
    outputs = tp2.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    for daemon in tp2.prefill_daemons:  # both prefill ranks' holds were consumed
        # An early hold released and held anew on a slow step (issue #41) ends EXPIRED "released" first: not a
        # hold that was handed over (docs/vllm.md); every hold decode read must end CONSUMED, once.
        events = hold_ends(daemon, "prefill-tp2")
        assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts), _post_mortem(tp2)


def test_prefill_tp1_to_decode_tp2_with_longer_decode_blocks(tp2):
    """One prefill rank (blocks of 32) holds; each of two decode ranks (blocks of 64) reads its two heads."""
    prompts = random_prompts(9)
    single = single_instance(tp2.decode_tp2, prompts, 8)
    params = prefill_params(tp2.decode, prompts)  # decode-recompute (TP 1) acts as the prefill here
    read_before = [metric(d, "kvxferd_read_bytes_total") for d in tp2.decode_tp2_daemons]
    outputs = tp2.decode_tp2.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    # Each decode rank read half of every prefill block (2 of 4 heads), and nothing twice.
    read = [metric(d, "kvxferd_read_bytes_total") - before for d, before in zip(tp2.decode_tp2_daemons, read_before)]
    assert read == [sum(-(-len(p) // 32) for p in prompts) * BLOCK_BYTES // 2] * 2, read
    events = hold_events(tp2.recompute_daemon, "decode-recompute")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)
    # Negative control: the same prompts again with prefill's heads reversed in its held blocks (what
    # reading each rank's heads from the wrong place would give) change decode's tokens.
    assert tp2.decode_tp2.reset_prefix_cache()
    params = prefill_params(tp2.decode, prompts)
    damage_blocks(tp2.decode, [b for p in params for b in p["remote_block_ids"][0]], "reversed_heads")
    outputs = tp2.decode_tp2.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert sum(changed(token_ids(outputs), single)) >= len(prompts) - 1, (token_ids(outputs), single)
    for llm in (tp2.decode, tp2.decode_tp2):  # the damaged blocks stay in both prefix caches
        wait_for_reset(llm)


def _post_mortem(tp2) -> str:
    """What the daemons counted and logged (a failed read is recomputed here, so tokens do not show it)."""
    import urllib.request
    lines = []
    for daemon in (tp2.recompute_daemon, *tp2.prefill_daemons):  # the reader first: its lines matter most
        text = urllib.request.urlopen(daemon.addresses["metrics"], timeout=5).read().decode()
        lines += [f"{daemon.daemon_id}: {line}" for line in text.splitlines()  # (zeros left out)
                  if line.startswith(("kvxferd_read_failures_total", "kvxferd_holds_pending", "kvxferd_stale",
                                      "kvxferd_notices", "kvxferd_late", "kvxferd_read_bytes_total"))
                  and not line.endswith(" 0.0")]
        lines += [line for line in daemon.tail(30000).splitlines() if '"DEBUG"' not in line][-15:]
    for daemon in tp2.prefill_daemons:  # how each prefill hold ended, and why (an EXPIRED's reason)
        recorder = _RECORDERS[(daemon.addresses["notify"], "prefill-tp2")]
        lines += [f"{daemon.daemon_id}: hold {request_id}: {list(zip(kinds, recorder.reasons.get(request_id, [])))}"
                  for request_id, kinds in list(recorder.events.items())[-12:]]
    return "\n".join(lines)


def test_a_damaged_prefill_block_is_caught_by_its_digests_and_recomputed(tp2):
    """Issue #59 on a real vLLM: prefill's held blocks damaged after the hold (each rank's KV heads reversed,
    what a wrong head mapping would read). Checked against the hold's digests (the prefill leg asks with
    kvxferd_verify), every read fails as corrupt and decode recomputes: the single instance's tokens.
    Unchecked, the same damage reaches decode and changes them (the negative control)."""
    prompts = random_prompts(4)
    single = single_instance(tp2.decode, prompts, 6)
    corrupt = 'kvxferd_read_failures_total{kind="corrupt"}'
    for verify in (True, False):
        before = metric(tp2.recompute_daemon, corrupt)
        params = prefill_params(tp2.prefill, prompts, {"kvxferd_verify": verify})
        assert [len(p.get("remote_digests", [])) for p in params] == [2 if verify else 0] * len(prompts)
        damage_blocks(tp2.prefill, [b for p in params for b in p["remote_block_ids"][0]], "reversed_heads")
        outputs = tp2.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
        if verify:
            assert token_ids(outputs) == single, _post_mortem(tp2)
            # (a daemon counts a read just after it sent its completion; a starved CI machine saw its loop
            # wake 5 s late)
            assert eventually(lambda: metric(tp2.recompute_daemon, corrupt) >= before + len(prompts), 30.0), \
                _post_mortem(tp2)  # (every daemon's read failures by kind, and its last lines)
            assert metric(tp2.recompute_daemon, corrupt) == before + len(prompts)
        else:
            assert sum(changed(token_ids(outputs), single)) >= len(prompts) - 1, (token_ids(outputs), single)
            assert metric(tp2.recompute_daemon, corrupt) == before
        for daemon in tp2.prefill_daemons:  # every hold ends, a failed read's too (its reader reported): waited
            ends = hold_ends(daemon, "prefill-tp2")  # for on the bus, so prefill's blocks can be freed
            assert [ends.get(p["remote_request_id"], [None])[-1] for p in params] == ["CONSUMED"] * len(prompts), \
                _post_mortem(tp2)
        for llm in (tp2.prefill, tp2.decode):  # damaged blocks in prefill's cache, recomputed ones in decode's
            wait_for_reset(llm)


def test_a_failed_read_is_recomputed_under_recompute_with_the_same_tokens(tp2):
    """Last in the file: the hold of the read made to fail is never read, and keeps its prefill blocks until
    its lease (60 s) runs out, which a later test's prefix-cache reset would wait for."""
    prompts = random_prompts(6, (130, 45))
    single = single_instance(tp2.decode, prompts, 6)
    params = prefill_params(tp2.prefill, prompts)
    params[0] = released_early(params[0])
    failures_before = metric(tp2.recompute_daemon, 'kvxferd_read_failures_total{kind="refused"}')
    outputs = tp2.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert token_ids(outputs) == single
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert metric(tp2.recompute_daemon, 'kvxferd_read_failures_total{kind="refused"}') == failures_before + 1
