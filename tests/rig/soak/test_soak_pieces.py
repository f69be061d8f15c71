"""The soak's own bookkeeping: fault cycle, pairings, and the hold ledger's exactly-once check."""

from __future__ import annotations

import collections

import numpy as np

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.soak.configs import check_config, draw_config
from kvxferd.rig.soak.faults import CAN_BE_MID, KINDS, FaultPlan
from kvxferd.rig.soak.holds import HoldLedger


def test_the_fault_cycle_reaches_every_kind_evenly():
    plan = FaultPlan(np.random.default_rng(0), rate=1.0)
    drawn = [plan.next() for _ in range(10 * len(KINDS))]
    counts = collections.Counter(kind for kind, _ in drawn)
    assert counts == {kind: 10 for kind in KINDS}
    assert all(kind in CAN_BE_MID for kind, mid in drawn if mid)
    assert any(mid for _, mid in drawn) and not all(mid for _, mid in drawn)
    assert FaultPlan(np.random.default_rng(0), rate=0.0).next() == (None, False)


def test_drawn_pairings_plan_and_cover_the_space():
    rng = np.random.default_rng(3)
    configs = [draw_config(rng)[0] for _ in range(80)]
    for config in configs:
        check_config(config)  # raises if the daemons would refuse it
    assert {c.model for c in configs} == {"gqa", "fp8", "mla", "swa", "hybrid"}
    assert {c.prefill_tp for c in configs} == {1, 2, 3, 4} == {c.decode_tp for c in configs}
    assert any(c.prefill_tp % c.decode_tp and c.decode_tp % c.prefill_tp for c in configs)  # non-divisible pairs
    assert any(c.shape.prefill_block_size != c.shape.decode_block_size for c in configs)
    assert any(c.shape.kernel_block_size for c in configs) and any(c.cached_tokens for c in configs)
    assert any(c.shape.layout == "nhd" for c in configs)
    assert max(draw_config(np.random.default_rng(s), max_tp=2)[0].prefill_tp for s in range(20)) == 2


def _event(seq, request_id, kind, engine_id="e"):
    return pb.NotifyEvent(seq=seq, engine_id=engine_id, request_id=request_id, kind=kind)


def test_the_ledger_flags_a_second_end_an_unknown_hold_and_a_gap():
    violations = []
    ledger = HoldLedger(["tcp://127.0.0.1:9"], lambda invariant, detail: violations.append(invariant))
    try:
        ledger.placed(0, "e", "a", "ok")
        ledger.placed(0, "e", "b", "DEADLINE_EXCEEDED")  # may or may not have been placed
        ledger._accept(0, _event(1, "a", pb.NotifyEvent.CONSUMED))
        assert violations == [] and ledger.open_holds() == []
        ledger._accept(0, _event(2, "a", pb.NotifyEvent.EXPIRED))  # a hold ended twice
        ledger._accept(0, _event(3, "ghost", pb.NotifyEvent.EXPIRED))  # never held
        ledger._accept(0, _event(5, "b", pb.NotifyEvent.EXPIRED))  # seq 4 missing
        assert violations == ["hold_ends_once", "hold_ends_once", "bus_sequence"]
        assert ledger.counts() == {"CONSUMED": 1, "EXPIRED": 1, "lost_with_daemon": 0, "unplaced": 0, "open": 0}
    finally:
        ledger.close()


def test_holds_of_a_killed_daemon_are_lost_and_its_new_life_starts_a_new_sequence():
    violations = []
    ledger = HoldLedger(["tcp://127.0.0.1:9"], lambda invariant, detail: violations.append(detail))
    try:
        ledger.placed(0, "e", "a", "ok")
        ledger.placed(0, "e", "b", "ok")
        ledger._accept(0, _event(7, "a", pb.NotifyEvent.CONSUMED))
        ledger.daemon_killed(0)
        ledger.daemon_restarted(0)
        assert ledger.open_holds() == []  # "b" died with its daemon
        ledger.placed(0, "e", "c", "ok")
        assert len(ledger.open_holds()) == 1
        ledger._accept(0, _event(1, "c", pb.NotifyEvent.CONSUMED))  # seq 1 again: a new life, no gap
        ledger._accept(0, _event(2, "b", pb.NotifyEvent.EXPIRED))  # the old life's hold: unknown to the new one
        assert len(violations) == 1 and "never held" in violations[0]
        assert ledger.counts() == {"CONSUMED": 2, "EXPIRED": 0, "lost_with_daemon": 1, "unplaced": 0, "open": 0}
    finally:
        ledger.close()


def test_leaks_compare_one_life_and_always_flag_engine_memory_left():
    from kvxferd.rig.daemons import LEAK_SLACK, leaks

    start = {"pid": 1, "fds": 30, "threads": 15, "rss_bytes": 100 << 20, "other_shm_mappings": 0, "engine_shm": [],
             "engine_shm_fds": 0, "engines_registered": 0, "dataplane_workers": 0}
    assert leaks(start, dict(start)) == []
    grown = {**start, "fds": 30 + LEAK_SLACK["fds"] + 1}
    (problem,) = leaks(start, grown)
    assert problem.startswith("fds 30 -> 47")
    assert leaks(start, {**grown, "pid": 2}) == []  # killed and restarted since: a new life
    assert len(leaks(None, {**start, "engine_shm": ["/dev/shm/psm_1"], "engines_registered": 1})) == 1
    # With data-plane workers: an arena held open (not mapped) or a worker left is engine memory left too.
    for left in ({"engine_shm_fds": 1}, {"dataplane_workers": 1}):
        (problem,) = leaks(start, {**start, **left})
        assert "with no engine left" in problem


def test_the_end_measure_waits_for_a_registration_whose_deregistration_failed(monkeypatch):
    """A registration left by a failed deregistration lapses with its lease: the end waits for it, then
    measures; one that outlives its lease is measured (and then reported as a leak)."""
    import importlib
    import types

    run = importlib.import_module("kvxferd.rig.soak.run")

    clean = {"pid": 1, "fds": 30, "threads": 15, "rss_bytes": 1, "other_shm_mappings": 0, "engine_shm": [],
             "engine_shm_fds": 0, "engines_registered": 0, "dataplane_workers": 0}
    left = {**clean, "engine_shm": ["/dev/shm/psm_1"], "engines_registered": 1}
    for num_left, lapses in ((3, True), (10 ** 9, False)):
        calls = []

        def fake_measure(life, calls=calls, num_left=num_left):
            calls.append(life)
            return left if len(calls) <= num_left else clean

        clock = iter(range(10 ** 6))
        monkeypatch.setattr(run, "measure", fake_measure)
        monkeypatch.setattr(run, "time", types.SimpleNamespace(sleep=lambda s: None,
                                                               monotonic=lambda: next(clock) * 0.5))
        soak = types.SimpleNamespace(daemons=types.SimpleNamespace(all=[types.SimpleNamespace(
            daemon=types.SimpleNamespace(daemon_id="soak-p0"))]), report=types.SimpleNamespace(usage={}))
        run.Soak._measure(soak, "end")
        assert soak.report.usage["soak-p0"]["end"] == (clean if lapses else left)
        if not lapses:  # gave up after a lease and the reaping margin
            assert len(calls) <= (run.ENGINE_LEASE_S + run.REAP_MARGIN_S) / 0.5 + 2


def test_a_worker_death_the_soak_did_not_cause_is_reported_with_the_daemons_own_lines():
    """workers_alive's violation says why a worker ended (its exit code or signal, or why its supervisor
    killed it), from the daemon's log; the soak's own kill -9s are left out."""
    from kvxferd.rig.soak.workers import why_workers_died

    log = ("worker a-r generation 1 (pid 7) ended with -9; starting another\n"
           "worker a-w generation 2 (pid 9) ended with -6; starting another\n"
           "worker a-r generation 3: a message out of protocol; killing it\n")
    said = why_workers_died(log)
    assert "ended with -6" in said and "killing it" in said and "ended with -9" not in said
    assert why_workers_died("worker a-r generation 1 (pid 7) ended with -9; starting another") \
        == " (the log says nothing more)"
