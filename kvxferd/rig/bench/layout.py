"""Benchmark of the pure layers: span emission rate and plan (match) time.

    python -m kvxferd.rig.bench.layout            # 80 layers x 100 000 blocks
    python -m kvxferd.rig.bench.layout --json

A decode rank of TP 3 reads an 8-KV-head packed cache from prefill TP 2, so
its heads come from two prefill ranks with different narrowings (rank 1 of 3
holds heads [2, 5): [2, 4) from prefill rank 0 and [4, 5) from rank 1).
Layouts are metadata only: nothing of the 6 GB per layer is allocated.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kvxferd.rig.bench.common import bench_main, timed
from kvxferd.layout.builders import ORDERS, order_strides
from kvxferd.layout.match import match_layouts
from kvxferd.layout.spans import SpanTable
from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.reads import plan_region_reads


def run(num_layers: int = 80, num_blocks: int = 100_000, prefill_tp: int = 2, decode_tp: int = 3,
        decode_rank: int = 1, num_kv_heads: int = 8, repeat: int = 5, seed: int = 0) -> dict:
    """Measure; returns the figures as a dict."""
    spec = AttentionSpec("packed_HND", num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_size=128, block_size=16)
    prefill = [spec.region(prefill_tp, q) for q in range(prefill_tp)]
    local = spec.region(decode_tp, decode_rank)
    plan_s, reads = timed(lambda: plan_region_reads(local, prefill, decode_tp, decode_rank), repeat)
    nhd = spec.with_(layout="packed_NHD").region(decode_tp, decode_rank).fields[0].layout
    hnd = local.fields[0].layout
    match_mixed_s, _ = timed(lambda: match_layouts(hnd, nhd), repeat)
    # One region per layer at its own base address: stack the templates.
    bases = np.arange(num_layers, dtype=np.int64) * (1 << 40)
    tables = [SpanTable.from_template(r.template, bases, bases) for r in reads.reads]
    # Same TP on both sides: whole blocks, so contiguous block runs merge.
    same = plan_region_reads(spec.region(prefill_tp, 0), prefill, prefill_tp, 0)
    same_tables = [SpanTable.from_template(r.template, bases, bases) for r in same.reads]
    rng = np.random.default_rng(seed)
    scattered = rng.permutation(num_blocks)
    contiguous_ids = np.arange(num_blocks)
    figures = {
        "num_layers": num_layers, "num_blocks": num_blocks, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
        "decode_rank": decode_rank, "num_kv_heads": num_kv_heads,
        "reads": [f"rank {r.remote_rank}: heads [{r.slice.global_start}, {r.slice.global_stop})" for r in reads.reads],
        "plan_region_reads_ms": plan_s * 1e3, "match_hnd_nhd_ms": match_mixed_s * 1e3,
        "orders": order_spans(),
    }
    cases = (("scattered", scattered, False, tables), ("scattered_merged", scattered, True, tables),
             ("contiguous_merged", contiguous_ids, True, tables),
             ("same_tp_contiguous_merged", contiguous_ids, True, same_tables))
    for label, ids, merge, case_tables in cases:
        def emit_all():
            return sum(table.spans(ids, ids, merge=merge).num_spans for table in case_tables)
        seconds, num_spans = timed(emit_all, repeat)
        raw_spans = num_layers * num_blocks * len(case_tables)
        figures[label] = {"seconds": seconds, "spans_in": raw_spans, "spans_out": num_spans,
                          "mspans_per_s": raw_spans / seconds / 1e6}
    return figures


ORDER_TP_PAIRS = ((1, 1), (2, 1), (1, 2), (4, 8))


def order_spans(num_layers: int = 32, num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16) -> dict:
    """Descriptors per block read by decode rank 0 for each of vLLM 0.32's physical orders and a few TP pairs.

    Blocks are scattered (no two neighbours), so nothing merges across blocks: the count is what one
    block of the order costs. Both sides use the same order, one region holding every layer.
    """
    blocks = 16
    decode_ids, prefill_ids = np.arange(0, blocks, 2), np.arange(1, blocks, 2)

    def spec(order: str, tp: int) -> AttentionSpec:
        strides = order_strides(order, "kv", num_layers=num_layers, num_blocks=blocks, num_heads=num_kv_heads // tp,
                                block_size=block_size, head_size=head_size)
        return AttentionSpec("strided", blocks, num_kv_heads, head_size, block_size, num_layers=num_layers, strides=strides)

    out = {}
    for order in ORDERS:
        for p, d in ORDER_TP_PAIRS:
            reads = plan_region_reads(spec(order, d).region(d, 0), [spec(order, p).region(p, q) for q in range(p)], d, 0)
            spans = reads.spans(decode_ids, prefill_ids).values()
            num_spans, num_bytes = sum(x.num_spans for x in spans), sum(x.num_bytes for x in spans)
            out[f"{order} {p}->{d}"] = {"spans_per_block": num_spans / len(decode_ids), "bytes_per_span": num_bytes / num_spans}
    return out


def format_table(f: dict) -> str:
    lines = [
        f"layout bench: {f['num_layers']} layers x {f['num_blocks']} blocks, packed HND, {f['num_kv_heads']} KV heads, "
        f"decode rank {f['decode_rank']}/{f['decode_tp']} <- prefill TP {f['prefill_tp']}",
        "reads: " + "; ".join(f["reads"]),
        f"plan (narrow + match, per region):  {f['plan_region_reads_ms']:8.3f} ms",
        f"match HND <-> NHD:                  {f['match_hnd_nhd_ms']:8.3f} ms",
        "",
        f"{'request':<28}{'spans in':>12}{'spans out':>12}{'time (ms)':>12}{'M spans/s':>12}",
    ]
    for label in ("scattered", "scattered_merged", "contiguous_merged", "same_tp_contiguous_merged"):
        row = f[label]
        lines.append(f"{label:<28}{row['spans_in']:>12,}{row['spans_out']:>12,}{row['seconds'] * 1e3:>12.1f}{row['mspans_per_s']:>12.1f}")
    if "orders" in f:
        lines += ["", "vLLM 0.32 orders (32 layers, 8 KV heads, head 128, blocks of 16, bf16): descriptors per block "
                      "read by decode rank 0 (bytes per descriptor)",
                  f"{'order':<8}" + "".join(f"{f'P{p}->D{d}':>20}" for p, d in ORDER_TP_PAIRS)]
        for order in ORDERS:
            cells = [f["orders"][f"{order} {p}->{d}"] for p, d in ORDER_TP_PAIRS]
            lines.append(f"{order:<8}" + "".join(f"{c['spans_per_block']:>8.0f} ({c['bytes_per_span']:>8,.0f})" for c in cells))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-layers", type=int, default=80)
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    """Run with parsed arguments and print the figures."""
    figures = run(num_layers=args.num_layers, num_blocks=args.num_blocks, repeat=args.repeat)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.layout", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
