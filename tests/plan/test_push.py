"""Push plans (issue #57): the writes of every prefill rank into a decode rank are exactly its read, swapped."""

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.capability import hold_capability
from kvxferd.plan.engine import EngineTransferPlan, expected_readers
from kvxferd.plan.push import PushPlan, PushRequest, expected_writers, writing_ranks
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.models import MODELS, model_groups, random_request
from kvxferd.rig.verify.simulate import apply_planned_push

from tests.plan.test_engine import SHAPES, TP_PAIRS
from tests.sampling import covering

KEY = bytes(range(32))


def push_of(request, capability=None):
    """The push of a read-shaped request (decode ids local, prefill ids remote)."""
    capability = capability or hold_capability(KEY, request.remote_request_id, request.local_block_ids)
    return PushRequest(request.remote_request_id, request.local_block_ids, request.remote_block_ids, capability,
                       request.num_tokens)


def simulate_pushes(model, shape, p, d, requests):
    """Every prefill rank pushes every request into every decode rank, byte for byte; the problems found."""
    prefill_groups, decode_groups = model_groups(model, shape)
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=True) for q in range(p)]
    problems = []
    for r in range(d):
        decode = allocate_engine("D", decode_groups, d, r, tagged=False)
        plans = [PushPlan(writer.cache, decode.cache) for writer in prefill]
        read_plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
        notifying = [q for q, plan in enumerate(plans) if plan.notifies]
        if notifying != list(read_plan.notify_ranks):
            problems.append(f"rank {r}: writers notifying {notifying}, the read notifies {read_plan.notify_ranks}")
        if {plan.expected_writers for plan in plans} != {expected_writers(decode.cache, p)}:
            problems.append(f"rank {r}: writers expect {[pl.expected_writers for pl in plans]} notices, "
                            f"the target {expected_writers(decode.cache, p)}")
        for request in requests(prefill_groups, decode_groups):
            decode.reset()
            moved = sum(apply_planned_push(plan.plan_request(push_of(request)), writer, decode)
                        for plan, writer in zip(plans, prefill))
            if moved != read_plan.plan_request(request).num_bytes:
                problems.append(f"{request.request_id}: pushed {moved} bytes, the read moves "
                                f"{read_plan.plan_request(request).num_bytes}")
            problems += check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))
    return problems


@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES), product_of=2,
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_pushes_move_exactly_the_oracle_bytes(pair, model, shape):
    p, d = pair
    rng = np.random.default_rng(p * 100 + d)

    def requests(prefill_groups, decode_groups):
        yield random_request("full", prefill_groups, decode_groups, 77, rng)
        yield random_request("hit", prefill_groups, decode_groups, 77, rng, cached_tokens=32, window_tokens=20,
                             contiguous=False)

    assert simulate_pushes(model, SHAPES[shape], p, d, requests) == []


def test_a_push_of_other_blocks_is_caught_by_the_oracle():
    """Negative control: the simulated push of another request's prefill blocks fails the byte check."""
    prefill_groups, decode_groups = model_groups("gqa", SHAPES["plain"])
    rng = np.random.default_rng(7)
    request = random_request("full", prefill_groups, decode_groups, 64, rng)
    other = random_request("other", prefill_groups, decode_groups, 64, rng)
    prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=True)
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    plan = PushPlan(prefill.cache, decode.cache)
    wrong = PushRequest(request.remote_request_id, request.local_block_ids, other.remote_block_ids,
                        push_of(request).capability, request.num_tokens)
    apply_planned_push(plan.plan_request(wrong), prefill, decode)
    assert check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request)) != []


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("p, d", TP_PAIRS)
def test_the_target_counts_the_writers_the_holder_would_have_counted_as_readers(model, p, d):
    """Whoever notifies whom is symmetric: decode rank r hears from prefill rank q after a push exactly when
    q would have heard from r after a read."""
    prefill_groups, decode_groups = model_groups(model, SHAPES["replicated_heads"])
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=False).cache for q in range(p)]
    decode = [allocate_engine("D", decode_groups, d, r, tagged=False).cache for r in range(d)]
    writes = np.array([writing_ranks(target, p) for target in decode])  # [decode rank, prefill rank]
    reads = np.array([EngineTransferPlan(target, prefill).notify_ranks == tuple(np.flatnonzero(row))
                      for target, row in zip(decode, writes)])
    assert reads.all()
    assert [expected_readers(holder, d) for holder in prefill] == writes.sum(axis=0).tolist()


def test_bad_push_input_is_refused_naming_the_field():
    prefill_groups, decode_groups = model_groups("gqa", SHAPES["plain"])
    prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=False)
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    request = random_request("r", prefill_groups, decode_groups, 64, np.random.default_rng(1))
    plan = PushPlan(prefill.cache, decode.cache)
    with pytest.raises(InvalidArgumentError, match="transfer_id"):
        PushRequest("", request.local_block_ids, request.remote_block_ids, push_of(request).capability)
    with pytest.raises(InvalidArgumentError, match="capability"):
        PushRequest("t", request.local_block_ids, request.remote_block_ids, b"short")
    out_of_range = tuple(np.array([10**6]) for _ in request.local_block_ids)
    with pytest.raises(InvalidArgumentError, match="groups"):
        plan.plan_request(PushRequest("t", out_of_range, request.remote_block_ids, push_of(request).capability,
                                      request.num_tokens))
