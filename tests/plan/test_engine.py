"""Engine transfer plans, checked byte for byte by simulating NIXL's descriptors."""

import itertools

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError, TpConfigError
from kvxferd.plan.engine import EngineTransferPlan, ReadRequest, expected_readers, notifying_readers
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups, random_request
from kvxferd.plan.descriptors import expand_rows
from kvxferd.rig.verify.simulate import apply_planned_read

from tests.sampling import covering

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (4, 1), (1, 4), (2, 4), (4, 2), (3, 2), (2, 3), (8, 2)]
SHAPES = {
    "plain": ModelShape(),
    "replicated_heads": ModelShape(num_kv_heads=2, layout="nhd"),
    "kernel_split": ModelShape(kernel_block_size=8, layout="legacy"),
    "prefill_blocks_32": ModelShape(prefill_block_size=32),
    "decode_blocks_32": ModelShape(decode_block_size=32, kernel_block_size=16, num_kv_heads=3),
    # vLLM's CPU cache (K transposed per head): a block of one side is split into the other's units
    "cpu_prefill_blocks_32": ModelShape(prefill_block_size=32, layout="cpu"),
    "cpu_decode_blocks_32": ModelShape(decode_block_size=32, num_kv_heads=3, layout="cpu"),
}


def simulate(model, shape, p, d, requests):
    prefill_groups, decode_groups = model_groups(model, shape)
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=True) for q in range(p)]
    problems = []
    for r in range(d):
        decode = allocate_engine("D", decode_groups, d, r, tagged=False)
        plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
        for request in requests(prefill_groups, decode_groups):
            decode.reset()
            planned = plan.plan_request(request)
            # the bound a daemon decides with where to plan a read (before planning it)
            if plan.max_read_bytes(request) < planned.num_bytes:
                problems.append(f"{request.request_id}: bound {plan.max_read_bytes(request)} < {planned.num_bytes}")
            apply_planned_read(planned, decode, prefill)
            problems += check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))
    return problems


# Every TP pair x model (shapes in turn) in the default run; all 150 combinations with -m slow.
@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES), product_of=2,
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_plan_moves_exactly_the_oracle_bytes(pair, model, shape):
    p, d = pair
    rng = np.random.default_rng(p * 100 + d)

    def requests(prefill_groups, decode_groups):
        yield random_request("full", prefill_groups, decode_groups, 77, rng)
        yield random_request("hit", prefill_groups, decode_groups, 77, rng, cached_tokens=32, window_tokens=20,
                             contiguous=False)

    assert simulate(model, SHAPES[shape], p, d, requests) == []


def test_max_read_bytes_is_exact_when_every_block_is_read_whole():
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    prefill = [allocate_engine("P", prefill_groups, 2, q, tagged=False).cache for q in range(2)]
    plan = EngineTransferPlan(allocate_engine("D", decode_groups, 1, 0, tagged=False).cache, prefill)
    request = random_request("r", prefill_groups, decode_groups, 160, np.random.default_rng(0))
    assert plan.max_read_bytes(request) == plan.plan_request(request).num_bytes > 0


def test_notify_sets_cover_every_holder_of_every_group():
    prefill_groups, decode_groups = model_groups("hybrid", ModelShape(num_kv_heads=2))
    prefill = [allocate_engine("P", prefill_groups, 4, q, tagged=False).cache for q in range(4)]
    plans = [EngineTransferPlan(allocate_engine("D", decode_groups, 3, r, tagged=False).cache, prefill) for r in range(3)]
    for q in range(4):
        notifiers = sum(q in plan.notify_ranks for plan in plans)
        assert all(plan.expected_notifiers[q] == notifiers for plan in plans)
    # Two KV heads over 4 prefill ranks: each head lives on two ranks; all four hold data someone needs.
    assert sorted(set().union(*(plan.notify_ranks for plan in plans))) == [0, 1, 2, 3]
    for plan in plans:
        assert set(rp.remote_rank for rp in plan.rank_plans) <= set(plan.notify_ranks)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("model", MODELS)
def test_holder_counts_its_readers_as_every_reader_plan_does(model, shape):
    """The holder's own count (no reader plan at hand) equals each reader plan's, for every TP pair."""
    prefill_groups, decode_groups = model_groups(model, SHAPES[shape])
    for p, d in TP_PAIRS:
        prefill = [allocate_engine("P", prefill_groups, p, q, tagged=False).cache for q in range(p)]
        plans = [EngineTransferPlan(allocate_engine("D", decode_groups, d, r, tagged=False).cache, prefill)
                 for r in range(d)]
        assert [expected_readers(prefill[q], d) for q in range(p)] == [plans[0].expected_notifiers[q]
                                                                      for q in range(p)], (p, d)
        # Which reader ranks notify (and so read or replicate) each holder rank: exactly the plans that do.
        for q in range(p):
            assert notifying_readers(prefill[q], d).tolist() == [q in plan.notify_ranks for plan in plans], (p, d, q)


def test_contiguous_allocations_merge_to_one_descriptor_per_region():
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(num_layers=4))
    prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=False)
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    plan = EngineTransferPlan(decode.cache, [prefill.cache])
    contiguous = plan.plan_request(ReadRequest("r", "p", (np.arange(10, 20),), (np.arange(30, 40),)))
    assert contiguous.reads[0].num_descriptors == 4 * 10
    assert contiguous.count_merged_descriptors() == 4
    scattered = plan.plan_request(ReadRequest("r", "p", (np.arange(10, 30, 2),), (np.arange(30, 40),)))
    assert scattered.count_merged_descriptors() == 40


def test_strided_rows_prepare_in_constant_size():
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(num_blocks=5000, num_layers=3))
    prefill = [allocate_engine("P", prefill_groups, 2, q, tagged=False).cache for q in range(2)]
    plan = EngineTransferPlan(allocate_engine("D", decode_groups, 1, 0, tagged=False).cache, prefill)
    for rank_plan in plan.rank_plans:
        assert len(rank_plan.local_rows) == 3  # one row per region; the row walks 5000 blocks
        addresses, lengths = expand_rows(rank_plan.local_rows)
        assert len(addresses) == 3 * 5000 and np.all(lengths == lengths[0])


def test_request_errors_are_typed_before_any_descriptor():
    prefill_groups, decode_groups = model_groups("swa", ModelShape())
    prefill = [allocate_engine("P", prefill_groups, 1, 0, tagged=False).cache]
    plan = EngineTransferPlan(allocate_engine("D", decode_groups, 1, 0, tagged=False).cache, prefill)
    with pytest.raises(InvalidArgumentError) as err:
        plan.plan_request(ReadRequest("r", "p", ([1],), ([1], [2])))
    assert err.value.field == "local_block_ids"
    with pytest.raises(InvalidArgumentError) as err:
        plan.plan_request(ReadRequest("r", "p", ([1], [2, 3]), ([1], [999])))
    assert err.value.field == "groups[1].remote_block_ids[0]"


def test_engines_that_cannot_pair_are_refused():
    prefill_groups, decode_groups = model_groups("hybrid", ModelShape())
    gqa_prefill, _ = model_groups("gqa", ModelShape())
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False).cache
    with pytest.raises(LayoutMismatchError) as err:
        EngineTransferPlan(decode, [allocate_engine("P", gqa_prefill, 1, 0, tagged=False).cache])
    assert err.value.field == "groups"
    ranks = [allocate_engine("P", prefill_groups, 2, q, tagged=False).cache for q in range(2)]
    with pytest.raises(TpConfigError) as err:
        EngineTransferPlan(decode, ranks[::-1])
    assert err.value.field == "remotes[0].tp"
    fp8_prefill, _ = model_groups("fp8", ModelShape())
    _, gqa_decode = model_groups("gqa", ModelShape())
    with pytest.raises(LayoutMismatchError):
        EngineTransferPlan(allocate_engine("D", gqa_decode, 1, 0, tagged=False).cache,
                           [allocate_engine("P", fp8_prefill, 1, 0, tagged=False).cache])


def test_invalid_block_ids_name_the_groups_a_failed_rank_was_writing():
    prefill_groups, decode_groups = model_groups("hybrid", ModelShape(decode_block_size=32, prefill_block_size=16))
    prefill = [allocate_engine("P", prefill_groups, 2, q, tagged=False).cache for q in range(2)]
    plan = EngineTransferPlan(allocate_engine("D", decode_groups, 1, 0, tagged=False).cache, prefill)
    planned = plan.plan_request(ReadRequest("r", "p", ([7, 3], [5]), ([1, 2, 3, 4], [6]), num_tokens=60))
    attention, mamba = planned.invalid_block_ids([1])
    assert attention.tolist() == [3, 7] and mamba.tolist() == [5]
    assert all(len(ids) == 0 for ids in planned.invalid_block_ids([]))
    assert sum(itertools.chain(r.num_bytes for r in planned.reads)) == planned.num_bytes > 0


def test_a_state_group_without_a_local_page_reads_only_when_nothing_is_restored():
    """A hybrid read that restores the attention blocks must restore the state too (else vLLM resumes from
    a stale state); a read that restores nothing (it only ends the hold) may list no page anywhere."""
    prefill_groups, decode_groups = model_groups("hybrid", ModelShape())
    plan = EngineTransferPlan(allocate_engine("D", decode_groups, 1, 0, tagged=False).cache,
                              [allocate_engine("P", prefill_groups, 1, 0, tagged=False).cache])
    with pytest.raises(InvalidArgumentError) as err:
        plan.plan_request(ReadRequest("r", "p", ([7, 3], []), ([1, 2], [6]), num_tokens=32))
    assert err.value.field == "groups[1]"
    assert plan.plan_request(ReadRequest("r", "p", ([], []), ([1, 2], [6]), num_tokens=32)).num_bytes == 0
