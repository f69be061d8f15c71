"""``kvxferd bench holds``: every operation measured at each size, and expiry ends what is due."""

from kvxferd.rig.bench import holds


def test_holds_bench_measures_every_operation():
    figures = holds.run(sizes=(10, 1000))
    for f in figures["sizes"]:
        assert all(f[key] > 0 for key in ("hold_ns", "renew_ns", "record_ns", "release_ns", "expire_ns_per_end"))
        # a tenth consumed, a tenth released; of the rest, those due by the sweep's time ended
        assert 0 < f["expired"] <= f["holds"] - 2 * max(1, f["holds"] // 10)
    assert len(holds.format_table(figures).splitlines()) == 2 + 2  # two header lines, one row per size
