"""Full-size layout benchmark, on request: ``scripts/test.sh -m slow -s``."""

import pytest

from kvxferd.rig.bench.layout import format_table, run


@pytest.mark.slow
def test_full_size_layout_bench_prints_figures():
    figures = run()
    print("\n" + format_table(figures))
    assert figures["scattered"]["spans_in"] == 80 * 100_000 * 2
