"""The demo's verdict: any wrong byte, failed request, lost or stray event makes it fail."""

import pytest

from kvxferd.rig.demo import summary as figures


def _row(**read_changes):
    row = figures.new_row("gqa", 2, 1, "full")
    for i in range(3):
        result = {"ok": True, "latency_s": 0.001 * (i + 1), "errors": [], "bytes": 1000, "descriptors": 10,
                  "post_s": 0.0, "verified_bytes": 4000, "mismatched_bytes": 0, "mismatches": []}
        figures.add_read(row, {**result, **(read_changes if i == 1 else {})})
    return row


def _finish(row, *, events=None, raw_bytes=3000):
    figures.add_events(row, events or {"consumed": 6, "missing": [], "other": []}, 6)
    row["raw_s"], row["raw_bytes"] = [0.0005] * 3, raw_bytes
    return figures.finish_row(row)


def test_clean_row_figures():
    row = _finish(_row())
    assert row["ok"] and row["requests"] == 3 and row["bytes"] == 3000 and row["descriptors_per_request"] == 10
    assert row["latency_p50_ms"] == pytest.approx(2.0) and row["latency_p99_ms"] == pytest.approx(2.98)
    assert row["gbps"] == pytest.approx(3000 / 0.006 / 1e9) and row["raw_gbps"] == pytest.approx(3000 / 0.0015 / 1e9)
    assert row["ratio"] == pytest.approx(0.25)
    summary = figures.summarize([row, _finish(_row())])
    assert summary["ok"] and summary["requests"] == 6 and summary["consumed"] == 12 and summary["ratio"] == pytest.approx(0.25)
    assert "byte-exact" in figures.format_table(summary)


@pytest.mark.parametrize("row", [
    lambda: _finish(_row(mismatched_bytes=5, mismatches=["group 0 region 1: wrong"])),
    lambda: _finish(_row(ok=False, errors=["rank 0: deadline"])),
    lambda: _finish(_row(), events={"consumed": 5, "missing": ["r rank 1: no CONSUMED"], "other": []}),
    lambda: _finish(_row(), events={"consumed": 6, "missing": [], "other": ["r rank 0: stray EXPIRED"]}),
    lambda: _finish(_row(), raw_bytes=2999),
], ids=["wrong bytes", "failed read", "lost event", "stray event", "raw moved other bytes"])
def test_any_problem_fails_the_row_and_the_summary(row):
    row = row()
    summary = figures.summarize([_finish(_row()), row])
    assert not row["ok"] and not summary["ok"]
    assert "FAILED" in figures.format_table(summary)


def test_stage_figures_are_p50_per_stage_and_printed_next_to_the_latency():
    row = figures.new_row("gqa", 2, 1, "full")
    for i in range(3):
        stages = {"to_daemon": 0.001 * (i + 1), "plan": 0.0002, "post": 0.003, "transfer": 0.0, "check": 0.0005,
                  "to_engine": 0.0007}
        figures.add_read(row, {"ok": True, "latency_s": 0.006, "errors": [], "bytes": 1000, "descriptors": 10,
                               "post_s": 0.0, "verified_bytes": 4000, "mismatched_bytes": 0, "mismatches": [],
                               "stages_s": stages})
    row = _finish(row)
    assert row["stage_p50_ms"]["to_daemon"] == pytest.approx(2.0) and row["stage_p50_ms"]["post"] == pytest.approx(3.0)
    text = figures.format_table(figures.summarize([row]))
    assert "where a read's time went" in text and "post+copy" in text
    assert text.splitlines()[-4].split()[:3] == ["gqa", "2.00", "0.20"]


def test_no_stage_figures_no_stage_table():
    assert "where a read's time went" not in figures.format_table(figures.summarize([_finish(_row())]))


def test_no_rows_is_not_a_success():
    assert not figures.summarize([])["ok"]
