"""Full-size data-plane benchmark, on request: ``scripts/test.sh -m slow -s``."""

import pytest

from kvxferd.rig.bench.xfer import format_table, run


@pytest.mark.slow
def test_full_size_xfer_bench_prints_figures():
    figures = run()
    print("\n" + format_table(figures))
    assert figures["plan_build"]["descriptors_per_side"] == 2 * 80 * 100_000
    assert figures["bulk_contiguous"]["merged_descriptors"] == 16
