"""vLLM prefill/decode through kvxferd: the same greedy tokens as one instance, on a real vLLM (CPU).

Two vLLM engines share one tiny model (normal-scale weights from a fixed
seed, so its tokens depend on the KV cache): a prefill instance (also the
single-instance reference) and a decode instance with
``kv_load_failure_policy=fail``; each has its own kvxferd daemon. Requests go
prefill (one token) -> kv_transfer_params -> decode, as a proxy would send
them. The negative controls read wrong KV (another request's, blocks out of
order, heads swapped, K and V swapped) and must change the tokens: they show
that "the same tokens" checks the bytes, not only the control flow.
``test_vllm_tp2_recompute.py`` has TP 2 -> 1, TP 1 -> 2 with other block sizes
and the ``recompute`` policy (its own engines: the files run side by side).
"""

from __future__ import annotations

import os
import time

import pytest

from kvxferd.client import DaemonProcess
from kvxferd.rig.otlp import SpanReceiver

from tests.integrations.vllm_cluster import (BLOCK_BYTES, BLOCK_SIZE, changed, damage_blocks, engine,
                                             greedy, hold_ends, metric, prefill_decode, prefill_params,
                                             prompt_tokens_by_source, prompts_of, random_prompts, released_early,
                                             rotate_blocks, tiny_model_and_daemons, token_ids, wait_for_reset)
from tests.integrations.vllm_stats_check import connector_metrics

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def otlp():
    """An OTLP receiver the daemons and both engines send their spans to (issue #60): traces are on in this
    file; the other vLLM files run with them off."""
    previous = {name: value for name, value in os.environ.items() if name.startswith("OTEL_")}
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # vLLM's span processor (this process) exports within 0.1 s
    try:
        with SpanReceiver() as receiver:
            yield receiver
    finally:  # (vLLM's tracer setup writes OTEL_EXPORTER_OTLP_TRACES_ENDPOINT here too: later daemons stay off)
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            del os.environ[name]
        os.environ.update(previous)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, otlp):
    # Same-host copies here (the other vLLM tests read over NIXL): every negative control below is one
    # for the copy path too.
    model, daemons = tiny_model_and_daemons(tmp_path_factory.mktemp("vllm"), ["vp0", "vd0"], same_host=True,
                                            env=otlp.environment())
    with prefill_decode(model, daemons, "prefill", "decode", otlp_traces_endpoint=otlp.endpoint) as cluster:
        yield cluster


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def test_prefill_decode_gives_the_single_instance_tokens(pd):
    prompts = random_prompts(1)
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    assert all(p and p.get("remote_block_ids") for p in params), params
    read_before = metric(pd.decode_daemon, "kvxferd_read_bytes_total")
    copies_before = metric(pd.decode_daemon, "kvxferd_same_host_copies_total")
    sources_before, stats_before = prompt_tokens_by_source(pd.decode), connector_metrics(pd.decode)
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
    # The decode daemon copied them itself from the prefill engine's memory (the connector passed it as
    # an fd: opened through the prefill daemon's copy), not over NIXL.
    assert metric(pd.decode_daemon, "kvxferd_same_host_copies_total") - copies_before == len(prompts)
    # vLLM's own metrics (the connector's stats hooks) count the same reads and bytes.
    stats = {k: v - stats_before.get(k, 0) for k, v in connector_metrics(pd.decode).items()}
    assert (stats["vllm:kvxferd_num_transfers"], stats["vllm:kvxferd_num_failed_transfers"],
            stats["vllm:kvxferd_transferred_bytes"], stats["vllm:kvxferd_transfer_time_seconds_count"]) == (
        len(prompts), 0, read, len(prompts)), stats
    # Every prefill hold ended exactly once, CONSUMED, and none is left.
    events = hold_ends(pd.prefill_daemon, "prefill")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"]] * len(prompts)
    assert metric(pd.prefill_daemon, "kvxferd_holds_pending") == 0


def test_another_requests_kv_changes_the_tokens(pd):
    """Negative control: two sets of prompts of the same lengths, each decoded with the other's params.
    Every read succeeds (the bytes are real KV, of the wrong request) and the tokens must change."""
    first, second = random_prompts(21), random_prompts(22)
    single = token_ids(pd.prefill.generate(prompts_of(first + second), greedy(8), use_tqdm=False))
    params = prefill_params(pd.prefill, first + second)
    crossed = params[len(first):] + params[:len(first)]
    outputs = pd.decode.generate(prompts_of(first + second), [greedy(8, p) for p in crossed], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(outputs)
    assert sum(changed(token_ids(outputs), single)) >= len(outputs) - 1, (token_ids(outputs), single)


def test_blocks_read_out_of_order_change_the_tokens(pd):
    """Negative control: each request's held blocks rotated by one in place before decode reads them (what
    reading its own blocks in the wrong order would deliver). Prompts of one block keep their tokens; longer
    prompts change, all but at most one, as in the other controls: a tiny random model's greedy tokens can
    collapse into one repeated token that ignores the context (seen for the 64-token prompt on an AMD EPYC
    host: [162, 478, 478, ...] either way), and where that happens depends on the CPU's float kernels."""
    prompts = random_prompts(23)
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    rotate_blocks(pd.prefill, [p["remote_block_ids"][0] for p in params])
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(outputs)  # every read went through
    differ = changed(token_ids(outputs), single)
    multi_block = [blocks(len(p)) > 1 for p in prompts]
    assert not any(d for d, multi in zip(differ, multi_block) if not multi), (token_ids(outputs), single)
    assert sum(d for d, multi in zip(differ, multi_block) if multi) >= sum(multi_block) - 1, (token_ids(outputs), single)
    wait_for_reset(pd.prefill)  # the rotated blocks stay in prefill's prefix cache


def test_a_client_cannot_read_blocks_its_params_were_not_sealed_for(pd):
    """Issue 35 through vLLM: ``kv_transfer_params`` come with the HTTP request. A client that names another
    request's held blocks (with its own request's capabilities), or its own blocks in another order, gets a
    failed load: the decode daemon refuses the read before a byte moves, and the other request's hold is
    still there for its own reader, which then gets the single-instance tokens."""
    mine, theirs = random_prompts(26, (48,)), random_prompts(27, (48,))
    single = token_ids(pd.prefill.generate(prompts_of(mine + theirs), greedy(8), use_tqdm=False))
    (my_params, their_params) = prefill_params(pd.prefill, mine + theirs)
    refused_before = metric(pd.decode_daemon, 'kvxferd_read_failures_total{kind="refused"}')
    attacks = [{**my_params, "remote_block_ids": their_params["remote_block_ids"]},
               {**my_params, "remote_block_ids": [ids[::-1] for ids in my_params["remote_block_ids"]]}]
    outputs = pd.decode.generate(prompts_of(mine * len(attacks)), [greedy(8, p) for p in attacks], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * len(attacks)
    assert metric(pd.decode_daemon, 'kvxferd_read_failures_total{kind="refused"}') == refused_before + len(attacks)
    # Both holds are still there: each request's own read gets its tokens and ends its hold.
    outputs = pd.decode.generate(prompts_of(mine + theirs), [greedy(8, p) for p in (my_params, their_params)],
                                 use_tqdm=False)
    assert token_ids(outputs) == single
    events = hold_ends(pd.prefill_daemon, "prefill")
    assert [events.get(p["remote_request_id"]) for p in (my_params, their_params)] == [["CONSUMED"]] * 2


@pytest.mark.parametrize("how", ["reversed_heads", "swapped_k_v"])
def test_heads_or_k_v_in_the_wrong_place_change_the_tokens(pd, how):
    """Negative control: prefill's held blocks damaged in place (KV heads reversed, or K and V swapped)
    before decode reads them: what a wrong head or K/V mapping would deliver. The tokens must change."""
    prompts = random_prompts(24 if how == "reversed_heads" else 25)
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(8), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    damage_blocks(pd.prefill, [b for p in params for b in p["remote_block_ids"][0]], how)
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    assert sum(changed(token_ids(outputs), single)) >= len(prompts) - 1, (token_ids(outputs), single)
    wait_for_reset(pd.prefill)  # the damaged blocks stay in prefill's prefix cache


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
    assert hold_ends(pd.prefill_daemon, "prefill")[params["remote_request_id"]] == ["CONSUMED"]


def test_a_failed_read_fails_that_request_under_fail_and_the_engines_keep_serving(pd):
    prompts = random_prompts(4, (70, 40))
    single = token_ids(pd.prefill.generate(prompts_of(prompts), greedy(6), use_tqdm=False))
    params = prefill_params(pd.prefill, prompts)
    params[0] = released_early(params[0])  # the blocks are freed before decode reads them
    stats_before = connector_metrics(pd.decode)
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(6, p) for p in params], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    stats = {k: v - stats_before.get(k, 0) for k, v in connector_metrics(pd.decode).items()}
    assert (stats["vllm:kvxferd_num_transfers"], stats["vllm:kvxferd_num_failed_transfers"],
            stats["vllm:kvxferd_transferred_bytes"]) == (2, 1, blocks(40) * BLOCK_BYTES), stats
    assert token_ids(outputs)[1] == single[1] and outputs[1].outputs[0].finish_reason == "length"
    # ... and the next request is served as if nothing happened.
    again = random_prompts(5, (90,))
    expected = token_ids(pd.prefill.generate(prompts_of(again), greedy(6), use_tqdm=False))
    result = pd.decode.generate(prompts_of(again), [greedy(6, prefill_params(pd.prefill, again)[0])], use_tqdm=False)
    assert token_ids(result) == expected


def test_decode_requests_aborted_before_and_after_their_read_end_their_holds(pd):
    """A decode request aborted before its scheduler matched it releases the prefill hold with an
    empty read (vLLM never hears of that read); one aborted mid-generation had its read already.
    Both holds end CONSUMED within seconds (not EXPIRED at the lease), and decode keeps serving."""
    prompts = random_prompts(26, (100, 200))
    params = prefill_params(pd.prefill, prompts)
    engine = pd.decode.llm_engine
    early, late = prompts_of(prompts)
    engine.abort_request([engine.add_request("abort-early", early, greedy(50, params[0]))], internal=True)
    late_id = engine.add_request("abort-late", late, greedy(300, params[1]))
    deadline = time.monotonic() + 60
    while not any(o.outputs[0].token_ids for o in engine.step() if o.request_id == "abort-late"):
        assert time.monotonic() < deadline
    engine.abort_request([late_id], internal=True)
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    deadline = time.monotonic() + 10  # well inside the 20 s lease
    while metric(pd.prefill_daemon, "kvxferd_holds_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    events = hold_ends(pd.prefill_daemon, "prefill")
    assert [events.get(p["remote_request_id"]) for p in params] == [["CONSUMED"], ["CONSUMED"]], events
    again = random_prompts(27, (90,))
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


def _traced_generate(llm, request_id: str, tokens: list[int], params, traceparent: str):
    """One request through ``llm`` with a W3C trace context in its headers, as vLLM's API server passes them."""
    engine = llm.llm_engine
    engine.add_request(request_id, prompts_of([tokens])[0], params, trace_headers={"traceparent": traceparent})
    while True:
        for output in engine.step():
            if output.finished:
                return output


def test_otel_a_traced_pd_request_is_one_trace_with_vllms_request_spans(pd, otlp):
    """Issue #60: a P/D request whose headers carry a trace context (the router's span) makes one trace in the
    OTLP receiver: vLLM's llm_request span of each leg, and kvxferd's spans of the prefill's hold (with its
    CONSUMED) and of decode's read with its stages, all under the router's span; decode's read joined it
    through the context the prefill put in kv_transfer_params (decode's own headers carried another). Only
    this request's trace holds kvxferd spans (the other requests here carried no context)."""
    (prompt,) = random_prompts(60, (90,))
    trace_id, router_span, decode_span = os.urandom(16).hex(), os.urandom(8).hex(), os.urandom(8).hex()
    single = token_ids(pd.prefill.generate(prompts_of([prompt]), greedy(6), use_tqdm=False))
    prefill = _traced_generate(pd.prefill, "otel-p", prompt, greedy(1, {"do_remote_decode": True}),
                               f"00-{trace_id}-{router_span}-01")
    params = prefill.kv_transfer_params
    assert params["traceparent"] == f"00-{trace_id}-{router_span}-01", params
    decode = _traced_generate(pd.decode, "otel-d", prompt, greedy(6, params), f"00-{trace_id}-{decode_span}-01")
    assert [list(decode.outputs[0].token_ids)] == single
    wanted = {"kvxferd.hold", "kvxferd.consumed", "kvxferd.read", "kvxferd.read.transfer"}
    spans = otlp.wait_for(lambda got: wanted <= {s.name for s in got}
                          and sum(s.name == "llm_request" for s in got) == 2, trace_id)
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert len(by_name.get("llm_request", [])) == 2, sorted(by_name)
    assert {s.parent_span_id for s in by_name["llm_request"]} == {router_span, decode_span}
    (hold,), (read,), (consumed,) = by_name["kvxferd.hold"], by_name["kvxferd.read"], by_name["kvxferd.consumed"]
    assert hold.parent_span_id == read.parent_span_id == router_span  # decode's read: the prefill's context
    assert consumed.parent_span_id == hold.span_id
    assert hold.attributes["kvxferd.engine_id"] == "prefill" and hold.attributes["kvxferd.hold.end"] == "CONSUMED"
    assert hold.attributes["kvxferd.request_id"] == params["remote_request_id"]
    assert read.attributes["kvxferd.engine_id"] == "decode" and read.attributes["kvxferd.read.ok"] is True
    assert read.attributes["kvxferd.read.bytes"] == blocks(len(prompt)) * BLOCK_BYTES
    stages = [s.name.rsplit(".", 1)[1] for s in sorted(spans, key=lambda s: s.start_ns)
              if s.name.startswith("kvxferd.read.")]
    assert stages[0] == "plan" and stages[-1] == "completion" and "transfer" in stages, stages
    assert all(s.parent_span_id == read.span_id for s in spans if s.name.startswith("kvxferd.read."))
    # the hold covers the read; both lie within the request (one host: one clock)
    assert hold.start_ns < read.start_ns <= read.end_ns <= hold.end_ns
    # every kvxferd span the receiver has is this request's: untraced requests made none
    assert {s.trace_id for s in otlp.spans() if s.name.startswith("kvxferd.")} == {trace_id}


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

