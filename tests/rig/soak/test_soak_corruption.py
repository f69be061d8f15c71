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
from kvxferd.rig.soak.configs import SoakConfig, draw_config
from kvxferd.rig.soak.misplan import misplan
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.damage import damage_held
from kvxferd.rig.verify.models import ModelShape, random_request
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


def _held(seed, config=None, cached=None):
    """A drawn pairing (or ``config``; ``cached``: force a prefix hit, or none) and a request held on it."""
    rng = np.random.default_rng(seed)
    config = config or draw_config(rng)[0]
    prefill_groups, _ = config.groups()
    request = config.request("r", rng)
    if cached is not None:
        request = random_request("r", *config.groups(), config.num_tokens, rng, cached_tokens=cached,
                                 window_tokens=32)
    prefill = [allocate_engine("P", prefill_groups, config.prefill_tp, q, tagged=True)
               for q in range(config.prefill_tp)]
    digests = tuple(digest_hold(e.cache, e.buffers, request.remote_block_ids) for e in prefill)
    return config, request.__class__(**{**request.__dict__, "remote_digests": digests}), prefill, rng


def _config(model, p, d, prefill_block, decode_block, num_tokens, kernel=None):
    shape = ModelShape(num_layers=2, num_kv_heads=4, head_size=32, block_size=decode_block,
                       prefill_block_size=prefill_block, decode_block_size=decode_block, kernel_block_size=kernel,
                       num_blocks=48)
    return SoakConfig(model, p, d, shape, num_tokens, 0)


# Pairings the damage must reach: a prefix hit reaching into the last prefill block (30 tokens, 16 of them
# cached: token 0 of that block is never read, its last token is), a window, kernel blocks, state pages.
CHOSEN = [(_config("gqa", 1, 1, 32, 8, 30), 16), (_config("swa", 2, 1, 16, 8, 150), 0),
          (_config("gqa", 1, 2, 8, 32, 70, kernel=16), 32), (_config("hybrid", 2, 2, 16, 16, 77), 0)]


@pytest.mark.parametrize("how", ["flip", "write"])
def test_a_held_block_changed_after_the_hold_is_caught_on_every_soak_pairing(how):
    caught = 0
    for seed, chosen in [(seed, None) for seed in SEEDS] + list(enumerate(CHOSEN)):
        config, request, prefill, rng = _held(seed, *(chosen or ()))
        for r in range(config.decode_tp):  # clean first: every unit checked, nothing named
            complaints, named, checked, unverifiable = _read(config, request, prefill, r)
            assert (complaints, named, unverifiable) == ([], set(), 0) and checked > 0, config.describe()
        for engine in prefill:
            damage_held(engine, request.remote_block_ids, how, rng, request.num_tokens)
        ranks_wrong = 0
        for r in range(config.decode_tp):
            complaints, named, _, _ = _read(config, request, prefill, r)
            ranks_wrong += bool(complaints)
            assert bool(named) == bool(complaints), (config.describe(), r, complaints[:2], named)
        assert ranks_wrong, config.describe()  # the damage sits where some decode rank reads it
        caught += ranks_wrong
    assert caught >= len(SEEDS) + len(CHOSEN)


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


def test_the_judge_counts_a_caught_corruption_and_flags_a_missed_or_false_one(tmp_path):
    """The soak's judge (corruption.py) on made-up outcomes: each way a read can go, counted or flagged."""
    import json
    from types import SimpleNamespace

    from kvxferd.rig.soak.corruption import Corruptions
    from kvxferd.rig.soak.report import Report

    report = Report(0, 1.0)
    corruptions = Corruptions(report, np.random.default_rng(0))
    request = SimpleNamespace(request_id="r")
    life = SimpleNamespace(daemon=SimpleNamespace(socket=str(tmp_path / "d1.sock")), index=1)

    def judge(kind, *outcomes, note=True):
        if kind == "misplanned_read" and note:
            (tmp_path / "d1.sock.misplanned").write_text(json.dumps({"request_id": "r", "how": "swapped"}))
        effect = {"kind": kind, "life": life, "misplanned_rank": 1} if kind else None
        corruptions.judge(request, {"ranks": [{"outcome": o} for o in outcomes]}, effect)
        return len(report.violations.get("corruption_caught", ())), dict(report.digests)

    assert judge(None, "ok", "ok")[0] == 0
    assert judge(None, "ok", "corrupt")[0] == 1  # a clean read failed corrupt: flagged
    assert judge("flip_held_byte", "ok", "corrupt") == (1, {"corruptions_injected": 1, "corruptions_caught": 1})
    assert judge("write_held_block", "failed", "ok")[1]["corruptions_unjudged"] == 1  # failed otherwise first
    assert judge("flip_held_byte", "ok", "ok")[0] == 2  # missed: flagged
    assert judge("misplanned_read", "ok", "corrupt")[1]["corruptions_caught"] == 2
    assert judge("misplanned_read", "ok", "lost")[1]["corruptions_unjudged"] == 2
    assert judge("misplanned_read", "corrupt", "ok")[0] == 4  # another rank corrupt, and this one missed
    assert judge("misplanned_read", "ok", "ok", note=False)[1]["not_injected"] == 1  # never planned wrong
    assert report.digests["corruptions_injected"] == 6
