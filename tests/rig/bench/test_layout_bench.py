"""The layout benchmark runs and counts spans correctly (small sizes)."""

from kvxferd.rig.bench.layout import format_table, run


def test_layout_bench_figures():
    figures = run(num_layers=3, num_blocks=50, repeat=1)
    assert figures["reads"] == ["rank 0: heads [2, 4)", "rank 1: heads [4, 5)"]
    assert figures["scattered"]["spans_in"] == figures["scattered"]["spans_out"] == 3 * 50 * 2
    # Same TP, contiguous ids: every layer's request is a single span.
    assert figures["same_tp_contiguous_merged"]["spans_out"] == 3
    assert "M spans/s" in format_table(figures)
