"""The soak's digest faults (issue #59) in-process, over the soak's own pairings: a byte flipped in the holder
after the hold, an engine writing into a held block, and a misplanned read (misplan.py) are each caught by
the holds' digests on every decode rank that read the change, naming the blocks the byte oracle finds wrong;
without the digests the same change reaches decode silently (the negative control). Reads simulated from
their plans; the soak itself runs them through real daemons (test_soak_run.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.plan.engine import EngineTransferPlan
from kvxferd.plan.holddigests import LocalDigests, check_read, digest_hold
from kvxferd.rig.soak.configs import draw_config
from kvxferd.rig.soak.misplan import misplan
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.damage import damage_held
from kvxferd.rig.verify.simulate import apply_planned_read

SEEDS = range(24)  # 24 drawn pairings: every model kind, TP 1..4 each side, blocks 8..32, prefix hits


def _read(config, request, prefill, r, wrong_plan=False):
    """Decode rank ``r``'s read from ``prefill``: (blocks the oracle finds wrong, blocks the digests name,
    atoms checked, units the digests could not check)."""
    prefill_groups, decode_groups = config.groups()
    decode = allocate_engine("D", decode_groups, config.decode_tp, r, tagged=False)
    plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
    planned = plan.plan_request(request)
    if wrong_plan and not misplan(plan, planned):
        return None
    apply_planned_read(planned, decode, prefill)
    complaints = check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))
    local = LocalDigests(decode.cache, decode.buffers)
    named, checked, unverifiable = set(), 0, 0
    for rank_plan in plan.rank_plans:
        result = check_read(local, plan.remotes[rank_plan.remote_rank], planned.units, plan.pairings,
                            rank_plan.groups, request.remote_digests[rank_plan.remote_rank])
        assert not result.malformed
        named |= {(g, int(b)) for g, ids in enumerate(result.bad_block_ids) for b in ids}
        checked, unverifiable = checked + result.num_atoms_checked, unverifiable + result.num_units_unverifiable
    return complaints, named, checked, unverifiable


def _held(seed):
    rng = np.random.default_rng(seed)
    config, _ = draw_config(rng)
    prefill_groups, _ = config.groups()
    request = config.request("r", rng)
    prefill = [allocate_engine("P", prefill_groups, config.prefill_tp, q, tagged=True)
               for q in range(config.prefill_tp)]
    digests = tuple(digest_hold(e.cache, e.buffers, request.remote_block_ids) for e in prefill)
    return config, request.__class__(**{**request.__dict__, "remote_digests": digests}), prefill, rng


@pytest.mark.parametrize("how", ["flip", "write"])
def test_a_held_block_changed_after_the_hold_is_caught_on_every_soak_pairing(how):
    caught = 0
    for seed in SEEDS:
        config, request, prefill, rng = _held(seed)
        for r in range(config.decode_tp):  # clean first: every unit checked, nothing named
            complaints, named, checked, unverifiable = _read(config, request, prefill, r)
            assert (complaints, named, unverifiable) == ([], set(), 0) and checked > 0, config.describe()
        for engine in prefill:
            damage_held(engine, request.remote_block_ids, how, rng)
        ranks_wrong = 0
        for r in range(config.decode_tp):
            complaints, named, _, _ = _read(config, request, prefill, r)
            ranks_wrong += bool(complaints)
            assert bool(named) == bool(complaints), (config.describe(), r, complaints[:2], named)
        assert ranks_wrong, config.describe()  # the damage sits where some decode rank reads it
        caught += ranks_wrong
    assert caught >= len(SEEDS)


def test_a_misplanned_read_is_caught_and_without_digests_passes_silently():
    caught = 0
    for seed in SEEDS:
        config, request, prefill, _ = _held(seed)
        outcome = _read(config, request, prefill, 0, wrong_plan=True)
        if outcome is None:  # one descriptor a rank: nothing to move
            continue
        complaints, named, _, _ = outcome
        assert complaints, config.describe()  # the misplan is real: decode got wrong bytes ...
        assert named, config.describe()  # ... which the digests catch; no check, no failure: silent
        caught += 1
    assert caught >= len(SEEDS) // 2
