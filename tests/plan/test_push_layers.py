"""A push written layer by layer (issue #57): each stage writes exactly the bytes of its layers, and the stages
together write exactly the whole push, for every model kind, shape and TP pair of the push matrix."""

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.region import LAYER_DIM
from kvxferd.layout.specs import AttentionSpec, MambaSpec
from kvxferd.plan.groups import CacheGroup
from kvxferd.plan.descriptors import expand_rows
from kvxferd.plan.push import PushPlan
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.models import MODELS, model_groups, random_request
from kvxferd.rig.verify.simulate import apply_planned_push

from tests.layout.brute import addresses
from tests.plan.test_engine import SHAPES, TP_PAIRS
from tests.plan.test_push import push_of
from tests.rig.verify.test_sweep import mamba_layers, strided
from tests.sampling import covering


def layer_of_byte(engine) -> np.ndarray:
    """Brute force, from the layouts: per byte of the engine's arena, ``group * 10_000 + layer`` of the layer
    it belongs to (-1: none). A region is one layer, or holds ``L`` of them (each field's elements at L=l)."""
    owner = np.full(len(engine.arena), -1, dtype=np.int64)
    base = engine.base_address
    for g, buffers in enumerate(engine.buffers):
        region = engine.cache.region(g)
        per_region = region.num_layers
        for r, buffer in enumerate(buffers):
            start = buffer.ctypes.data - base
            for field in region.fields:
                layout = field.layout
                for layer in range(per_region):
                    view = layout.select(LAYER_DIM, layer) if LAYER_DIM in layout.dims else layout
                    elements = addresses(view).ravel() * layout.itemsize
                    byte_offsets = (elements[:, None] + np.arange(layout.itemsize)[None, :]).ravel()
                    owner[start + byte_offsets] = g * 10_000 + r * per_region + layer
    return owner


def written_bytes(planned, write, target) -> np.ndarray:
    """Arena offsets of the target bytes a (stage of a) push writes."""
    addr, length = expand_rows(planned.plan.target_rows)
    starts = addr[write.remote_ids] - target.base_address
    return (starts[:, None] + np.arange(int(length[0]))[None, :]).ravel() if len(set(length[write.remote_ids])) == 1 \
        else np.concatenate([np.arange(s, s + n) for s, n in zip(starts, length[write.remote_ids])])


def staged_problems(prefill_groups, decode_groups, p, d, rng):
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=True) for q in range(p)]
    problems = []
    for r in range(d):
        decode = allocate_engine("D", decode_groups, d, r, tagged=False)
        owner = layer_of_byte(decode)
        counts = decode.cache.layer_counts
        request = random_request("staged", prefill_groups, decode_groups, 77, rng, cached_tokens=16, contiguous=False)
        whole = [PushPlan(writer.cache, decode.cache) for writer in prefill]
        layered = [PushPlan(writer.cache, decode.cache, by_layer=True) for writer in prefill]
        for plan, full in zip(layered, whole):
            if (plan.notifies, plan.expected_writers) != (full.notifies, full.expected_writers):
                problems.append(f"rank {r}: a plan by layer notifies differently")
        decode.reset()
        moved = 0
        for layer in range(max(counts)):  # every group's layer `layer` in one stage
            lo = np.minimum(layer, counts)
            hi = np.minimum(layer + 1, counts)
            for plan, writer in zip(layered, prefill):
                planned = plan.plan_request(push_of(request))
                stage = planned.stage(lo, hi)
                if stage is None:
                    continue
                hit = np.unique(owner[written_bytes(planned, stage, decode)])
                allowed = {g * 10_000 + layer for g in range(len(counts)) if layer < counts[g]}
                if not set(hit.tolist()) <= allowed:
                    problems.append(f"rank {r} layer {layer}: a stage wrote bytes of {sorted(set(hit.tolist()) - allowed)}")
                moved += apply_planned_push(planned, writer, decode, stage)
        full_bytes = sum(plan.plan_request(push_of(request)).num_bytes for plan in whole)
        if moved != full_bytes:
            problems.append(f"rank {r}: stages moved {moved} bytes, the whole push {full_bytes}")
        problems += check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))
    return problems


@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES), product_of=2,
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_stages_write_their_layers_and_together_the_whole_push(pair, model, shape):
    p, d = pair
    assert staged_problems(*model_groups(model, SHAPES[shape]), p, d, np.random.default_rng(p * 10 + d)) == []


def test_a_stage_is_caught_writing_another_layer():
    """Negative control: a stage taken for the wrong layers fails the brute-force owner check."""
    prefill_groups, decode_groups = model_groups("gqa", SHAPES["plain"])
    prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=True)
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    request = random_request("r", prefill_groups, decode_groups, 64, np.random.default_rng(3))
    planned = PushPlan(prefill.cache, decode.cache, by_layer=True).plan_request(push_of(request))
    counts = np.array(decode.cache.layer_counts)
    assert counts.max() > 1
    owner = layer_of_byte(decode)
    wrong = planned.stage(np.ones_like(counts), counts)  # layers 1.. taken as if they were layer 0
    hit = set(np.unique(owner[written_bytes(planned, wrong, decode)]).tolist())
    assert hit and not hit <= {g * 10_000 for g in range(len(counts))}


def test_stages_need_a_plan_by_layer_and_one_bound_per_group():
    prefill_groups, decode_groups = model_groups("gqa", SHAPES["plain"])
    prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=False)
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    request = random_request("r", prefill_groups, decode_groups, 64, np.random.default_rng(1))
    counts = decode.cache.layer_counts
    with pytest.raises(InvalidArgumentError, match="layer by layer"):
        PushPlan(prefill.cache, decode.cache).plan_request(push_of(request)).stage([0] * len(counts), counts)
    with pytest.raises(InvalidArgumentError, match="layer bounds"):
        PushPlan(prefill.cache, decode.cache, by_layer=True).plan_request(push_of(request)).stage([0], [1, 2, 3, 4])


@pytest.mark.parametrize("prefill_order, decode_order, mamba_orders", [
    ("BLHNC", "BLHNC", ("BL", "BL")), ("LBHNC", "LHBNC", ("BL", "LB")), ("BLNHC", "LBNHC", ("LB", "BL"))])
@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_layers_stored_inside_one_region_are_written_one_by_one(prefill_order, decode_order, mamba_orders, p, d):
    """vLLM 0.32's caches: every attention layer of a group in one strided view, every Mamba layer's pages in one
    region. A span of the whole push may run across layers (a block's layers side by side); a stage's may not."""
    attention = AttentionSpec("strided", num_blocks=12, num_kv_heads=4, head_size=4, block_size=16, num_layers=3)
    mamba = MambaSpec(num_blocks=12, num_heads=4, head_dim=2, num_groups=1, state_size=3, conv_window=3)

    def groups(tp, order, mamba_order):
        return [CacheGroup("full", strided(attention, tp, order, "kv")),
                CacheGroup("mamba", mamba_layers(mamba, tp, mamba_order))]

    prefill_groups, decode_groups = groups(p, prefill_order, mamba_orders[0]), groups(d, decode_order, mamba_orders[1])
    assert staged_problems(prefill_groups, decode_groups, p, d, np.random.default_rng(p + 7 * d)) == []
    # the case is one where layers share spans in the whole push (else it would prove nothing new)
    if (prefill_order, decode_order) == ("BLHNC", "BLHNC") and p == d == 1:
        whole = PushPlan(*(allocate_engine(n, g, 1, 0, tagged=False).cache for n, g in (("P", prefill_groups),
                                                                                         ("D", decode_groups))))
        layered = PushPlan(whole.writer, whole.target, by_layer=True)
        assert len(layered.writer_rows) > len(whole.writer_rows)
