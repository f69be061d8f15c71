"""``kvxferd bench processes``: each cost of the process split is measured and printed."""

from kvxferd.rig.bench import processes


def test_each_cost_of_the_split_is_measured():
    figures = {"questions": processes.questions(repeat=80, gap_s=1e-3), "worker_start": processes.worker_start(1)}
    assert set(figures["questions"]) == {"back_to_back", "every_1_ms", "fd_passed"}
    assert all(row["p99_us"] >= row["p50_us"] > 0 and row["cpu_us_asker"] > 0
               for row in figures["questions"].values())
    start = figures["worker_start"]
    assert start["start_s"][0] > 0 and start["rss_mib"][0] > 0
    assert start["registered_bytes"] == [processes.CACHE_BYTES]  # the worker mapped and registered the fd it got
    text = processes.format_table(figures)
    assert "fd passed" in text and "worker start" in text
