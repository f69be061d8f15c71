"""``kvxferd demo``: prefill -> decode reads over real NIXL, every byte checked.

For each model preset and TP pairing it starts a prefill and a decode
engine in this process, one NIXL agent (UCX over loopback) per TP rank with
host-memory caches filled with coordinate-tagged data. Each decode rank
plans its reads at handshake, then every request moves over NIXL (one
transfer per remote rank), every decode byte is compared with the oracle,
and every prefill rank must report the request released by all its readers.
Until the daemon exists (gRPC, notify bus) the engines run in-process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.tp.shards import check_tp
from kvxferd.verify.cluster import LocalCluster
from kvxferd.verify.models import DECODE_LAYOUTS, MODELS, ModelShape, model_groups, random_request


def run_pairing(model: str, shape: ModelShape, prefill_tp: int, decode_tp: int, args: argparse.Namespace,
                rng: np.random.Generator) -> dict:
    """Run ``args.requests`` requests of one preset over NIXL; returns one summary row."""
    prefill_groups, decode_groups = model_groups(model, shape)
    row = {"model": model, "pairing": f"{prefill_tp}->{decode_tp}", "groups": "+".join(g.kind for g in decode_groups),
           "requests": 0, "failed_requests": 0, "bytes": 0, "verified_bytes": 0, "mismatched_bytes": 0,
           "descriptors_posted": 0, "descriptors_merged": 0, "holds": 0, "unreleased": 0, "mismatches": []}
    latencies = []
    with LocalCluster(prefill_groups, decode_groups, prefill_tp, decode_tp, name=f"demo-{model}-{prefill_tp}-{decode_tp}") as cluster:
        for i in range(args.requests):
            cached = args.cached_tokens if i % 2 else 0  # every other request: a decode prefix-cache hit
            request = random_request(f"req{i}", prefill_groups, decode_groups, args.num_tokens, rng,
                                     cached_tokens=cached, window_tokens=args.window_tokens, contiguous=i % 3 != 2)
            cluster.reset_decode()
            start = time.perf_counter()
            results = cluster.read(request)
            latencies.append(time.perf_counter() - start)
            row["requests"] += 1
            row["failed_requests"] += sum(not r.ok for r in results)
            row["bytes"] += sum(r.num_bytes for r in results)
            row["descriptors_posted"] += sum(r.num_descriptors for r in results)
            for executor in cluster.executors:
                planned = executor.remote(cluster.prefill_id).plan.plan_request(request)
                row["descriptors_merged"] += planned.count_merged_descriptors()
            problems, wrong = cluster.verify(request)
            row["mismatches"] += problems + [r.error for r in results if not r.ok]
            row["mismatched_bytes"] += wrong
            row["verified_bytes"] += sum(e.arena.nbytes for e in cluster.decode)
            for q in range(prefill_tp):
                row["holds"] += 1
                if cluster.pump.wait_released(q, request.remote_request_id, timeout_s=10) is None:
                    row["unreleased"] += 1
    row["seconds"] = sum(latencies)
    row["gbps"] = row["bytes"] / max(row["seconds"], 1e-9) / 1e9
    row["latency_p50_ms"] = statistics.median(latencies) * 1e3
    row["latency_max_ms"] = max(latencies) * 1e3
    return row


def format_rows(rows: list[dict]) -> str:
    head = (f"{'model':<7}{'P->D':<6}{'groups':<11}{'reqs':>5}{'MiB':>8}{'GB/s':>7}{'p50 ms':>8}"
            f"{'desc/req':>10}{'merged':>8}{'released':>10}  result")
    lines = [head, "-" * len(head)]
    for row in rows:
        requests = max(row["requests"], 1)
        released = f"{row['holds'] - row['unreleased']}/{row['holds']}"
        verdict = "byte-exact" if not row["mismatches"] else f"MISMATCH: {row['mismatches'][0]}"
        lines.append(f"{row['model']:<7}{row['pairing']:<6}{row['groups']:<11}{row['requests']:>5}"
                     f"{row['bytes'] / 2**20:>8.1f}{row['gbps']:>7.2f}{row['latency_p50_ms']:>8.1f}"
                     f"{row['descriptors_posted'] / requests:>10.0f}{row['descriptors_merged'] / requests:>8.0f}"
                     f"{released:>10}  {verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS + ("all",), default="all", help="model preset (default: all)")
    parser.add_argument("--prefill-tp", type=int, help="prefill TP size (default: pairs 4->2, 2->3 and 2->2)")
    parser.add_argument("--decode-tp", type=int, help="decode TP size")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per logical block (both sides)")
    parser.add_argument("--prefill-block-size", type=int, help="prefill tokens per block (default: --block-size)")
    parser.add_argument("--decode-block-size", type=int, help="decode tokens per block (default: --block-size)")
    parser.add_argument("--kernel-block-size", type=int, default=None, help="decode tokens per kernel block")
    parser.add_argument("--num-blocks", type=int, default=64, help="decode blocks per cache")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--num-tokens", type=int, default=200, help="prompt tokens per request")
    parser.add_argument("--cached-tokens", type=int, default=32, help="decode prefix-cache hit on every other request")
    parser.add_argument("--window-tokens", type=int, default=64, help="sliding-window size of the swa preset")
    parser.add_argument("--layout", choices=sorted(DECODE_LAYOUTS), default="packed",
                        help="decode-side attention layout (prefill is packed HND)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _bad(message: str) -> int:
    print(f"kvxferd demo: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 when every byte matched and every hold was released, 1 otherwise, 2 on bad arguments."""
    if (args.prefill_tp is None) != (args.decode_tp is None):
        return _bad("give both --prefill-tp and --decode-tp, or neither")
    for flag in ("requests", "num_tokens"):
        if getattr(args, flag) < 1:
            return _bad(f"--{flag.replace('_', '-')} must be at least 1")
    pairings = [(args.prefill_tp, args.decode_tp)] if args.prefill_tp is not None else [(4, 2), (2, 3), (2, 2)]
    models = MODELS if args.model == "all" else (args.model,)
    shape = ModelShape(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                       block_size=args.block_size, kernel_block_size=args.kernel_block_size,
                       prefill_block_size=args.prefill_block_size, decode_block_size=args.decode_block_size,
                       num_blocks=args.num_blocks, layout=args.layout)
    rng = np.random.default_rng(args.seed)
    rows = []
    try:
        for p, d in pairings:
            check_tp(p, 0, field="prefill_tp")
            check_tp(d, 0, field="decode_tp")
        for model in models:
            prefill_groups, decode_groups = model_groups(model, shape)
            random_request("check", prefill_groups, decode_groups, args.num_tokens, rng)  # sizes fit the caches
            for p, d in pairings:
                rows.append(run_pairing(model, shape, p, d, args, rng))
                if not args.json:
                    print(format_rows(rows[-1:]).splitlines()[-1] if len(rows) > 1 else format_rows(rows), flush=True)
    except KvxferError as err:
        return _bad(str(err))
    except ValueError as err:  # e.g. more blocks per request than the cache has
        return _bad(f"{err} (try a larger --num-blocks or fewer --num-tokens)")
    summary = {
        "rows": rows,
        "requests": sum(r["requests"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
        "verified_bytes": sum(r["verified_bytes"] for r in rows),
        "mismatched_bytes": sum(r["mismatched_bytes"] for r in rows),
        "failed_requests": sum(r["failed_requests"] for r in rows),
        "unreleased": sum(r["unreleased"] for r in rows),
    }
    bad = summary["mismatched_bytes"] or summary["failed_requests"] or summary["unreleased"] or any(r["mismatches"] for r in rows)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"\n{summary['requests']} requests, {summary['bytes'] / 2**20:.1f} MiB over NIXL; "
              f"{summary['verified_bytes'] / 2**20:.1f} MiB of decode memory checked, {summary['mismatched_bytes']} bytes wrong; "
              f"{summary['failed_requests']} failed reads; {summary['unreleased']} prefill holds not released.")
        print("desc/req: descriptors posted per request (one per block, layer and span); merged: after NIXL joins "
              "neighbours contiguous on both sides. released: prefill rank holds freed by all their readers.")
    return 1 if bad else 0
