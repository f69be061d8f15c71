"""Region read plans: structure and typed errors for mismatched engines."""

import pytest

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError, SpanBudgetError, TpConfigError
from kvxferd.layout.specs import AttentionSpec, MambaSpec
from kvxferd.plan.reads import plan_region_reads

SPEC = AttentionSpec("packed_HND", num_blocks=8, num_kv_heads=8, head_size=16, block_size=4)


def prefill(spec=SPEC, tp=2):
    return [spec.region(tp, q) for q in range(tp)]


def test_heterogeneous_plan_reads_two_ranks():
    reads = plan_region_reads(SPEC.region(3, 1), prefill(), 3, 1)
    assert [(r.remote_rank, r.slice.global_start, r.slice.global_stop) for r in reads.reads] == [(0, 2, 4), (1, 4, 5)]
    assert reads.notify_ranks == (0, 1) and reads.read_ranks == (0, 1)
    spans = reads.spans([0, 1], [5, 6])
    assert sorted(spans) == [0, 1]
    assert spans[0].num_bytes == 2 * 2 * (4 * 2 * 16 * 2)  # 2 blocks x 2 heads
    assert spans[1].num_bytes == 2 * 1 * (4 * 2 * 16 * 2)


def test_mismatched_engines_are_typed():
    with pytest.raises(LayoutMismatchError) as err:
        plan_region_reads(SPEC.region(1, 0), prefill(SPEC.with_(num_kv_heads=4)), 1, 0)
    assert err.value.field == "remote[0].fields[kv].shard"
    with pytest.raises(LayoutMismatchError) as err:
        plan_region_reads(SPEC.region(1, 0), prefill(SPEC.with_(head_size=8)), 1, 0)
    assert err.value.field == "dims"
    with pytest.raises(LayoutMismatchError) as err:
        mamba = MambaSpec(num_blocks=8, num_heads=8, head_dim=2, num_groups=1, state_size=2, conv_window=2)
        plan_region_reads(SPEC.region(1, 0), prefill(mamba), 1, 0)
    assert err.value.field == "remote[0].fields"
    with pytest.raises(LayoutMismatchError) as err:
        plan_region_reads(SPEC.region(1, 0), prefill(SPEC.with_(dtype="float16")), 1, 0)
    assert err.value.field == "dtype"


def test_wrong_ranks_are_typed():
    with pytest.raises(TpConfigError) as err:
        plan_region_reads(SPEC.region(2, 0), prefill(), 2, 1)  # region built for rank 0
    assert err.value.field == "local.tp"
    with pytest.raises(TpConfigError):
        plan_region_reads(SPEC.region(2, 0), prefill(), 2, 2)
    with pytest.raises(TpConfigError) as err:
        plan_region_reads(SPEC.region(1, 0), [SPEC.region(2, 1), SPEC.region(2, 0)], 1, 0)
    assert err.value.field == "remote[0].tp_rank"
    with pytest.raises(InvalidArgumentError):
        plan_region_reads(SPEC.region(1, 0), [], 1, 0)


def test_span_budget_applies_to_plans():
    with pytest.raises(SpanBudgetError):
        plan_region_reads(SPEC.with_(layout="packed_NHD").region(1, 0), prefill(tp=1), 1, 0, max_spans_per_block=4)
