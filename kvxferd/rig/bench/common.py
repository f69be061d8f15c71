"""Helpers shared by the benchmark suites."""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.groups import CacheGroup


def full_attention_groups(num_layers: int, num_blocks: int) -> tuple[CacheGroup, ...]:
    """The benchmarks' cache: one full-attention group, packed HND, 8 KV heads of 128 channels, 16 tokens a
    block (bf16: 64 KiB a block and layer)."""
    spec = AttentionSpec("packed_HND", num_blocks=num_blocks, num_kv_heads=8, head_size=128, block_size=16)
    return (CacheGroup("full", spec, num_layers),)


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median wall time of ``repeat`` calls (seconds) and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def percentiles_us(values_s) -> dict:
    """p50 and p99 of durations in seconds, in µs."""
    values = np.asarray(values_s) * 1e6
    return {"p50_us": float(np.percentile(values, 50)), "p99_us": float(np.percentile(values, 99))}


def process_cpu_s() -> float:
    """CPU seconds this process used so far (every thread, user and system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_main(prog: str, doc: str | None, add_arguments, run_args, argv: list[str] | None) -> int:
    """``python -m`` entry point of a suite: its own parser, then ``run_args``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))
