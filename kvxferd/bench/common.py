"""Helpers shared by the benchmark suites."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median wall time of ``repeat`` calls (seconds) and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_main(prog: str, doc: str | None, add_arguments, run_args, argv: list[str] | None) -> int:
    """``python -m`` entry point of a suite: its own parser, then ``run_args``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))
