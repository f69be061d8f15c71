"""``kvxferd bench scale`` at tiny sizes: every remote-rank count reads, and a rate row reports."""

import tempfile

import pytest

from kvxferd.rig.bench import scale


def test_reading_from_more_ranks_posts_more_descriptors_for_the_same_bytes():
    rows = [scale.ranks_row(p, num_layers=2, blocks_per_request=4, rounds=2) for p in (1, 4)]
    assert [r["remote_ranks"] for r in rows] == [1, 4]
    assert rows[0]["bytes"] == rows[1]["bytes"] > 0
    assert rows[1]["descriptors"] == 4 * rows[0]["descriptors"]  # each rank's heads are their own span
    assert all(r["read_us"] > 0 and r["raw_us"] > 0 and r["plan_us"] > 0 for r in rows)


@pytest.mark.slow  # a daemon pair per rate
def test_rate_rows_report_each_batch_size():
    with tempfile.TemporaryDirectory() as workdir:
        rows = scale.rates(workdir, (200,), 0.5, (1, 4))
    assert [(r["reads_per_step"], r["failed"]) for r in rows] == [(1, 0), (4, 0)]
    assert all(r["p99_us"] >= r["p50_us"] > 0 and r["completed_rate_per_s"] > 0 for r in rows)
    text = scale.format_table({"ranks": [scale.ranks_row(1, 2, 4, 1)], "rates": rows})
    assert "offered rate through the daemons" in text
