"""``kvxferd demo``: plan and verify prefill -> decode reads for model presets.

Until the daemon exists this is the layout/TP demonstration: for each model
preset and TP pairing it builds every rank's cache region, plans each decode
rank's reads (which prefill ranks, which head/channel slices, whom to
notify), copies the planned spans between coordinate-tagged host buffers
with numpy, and checks every decode byte. Data moves in-process, not over
NIXL: the daemon issues (#3, #4) put NIXL under the same plans.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.layout.specs import AttentionSpec, CacheSpec, MambaSpec
from kvxferd.tp.shards import check_tp
from kvxferd.verify.scenario import run_scenario

MODELS = ("gqa", "fp8", "mla", "swa", "hybrid")
DECODE_LAYOUTS = {"packed": "packed_HND", "nhd": "packed_NHD", "legacy": "legacy"}


@dataclass(frozen=True)
class Group:
    """One cache group of a preset: its prefill and decode specs."""

    name: str
    prefill: CacheSpec
    decode: CacheSpec


def preset_groups(model: str, args: argparse.Namespace) -> list[Group]:
    """Cache groups of a model preset with command-line overrides applied."""
    attn = AttentionSpec("packed_HND", num_blocks=args.num_blocks, num_kv_heads=args.num_kv_heads,
                         head_size=args.head_size, block_size=args.block_size,
                         kernel_block_size=args.kernel_block_size)
    decode_layout = DECODE_LAYOUTS[args.layout]
    if model in ("gqa", "swa"):
        # A sliding-window group has the same layout as full attention; which
        # blocks it sends is a per-request matter of the transfer plan.
        groups = [Group("attention", attn, attn.with_(layout=decode_layout))]
        if model == "swa":
            groups.append(Group("sliding_window", attn, attn.with_(layout=decode_layout)))
        return groups
    if model == "fp8":
        fp8 = attn.with_(layout="split_kv", dtype="float8_e4m3fn")
        return [Group("attention_fp8", fp8, fp8)]
    if model == "mla":
        mla = attn.with_(layout="mla", head_size=args.head_size * 4 + 64)
        return [Group("mla_latent", mla, mla)]
    mamba = MambaSpec(num_blocks=args.num_blocks, num_heads=args.num_kv_heads * 4, head_dim=32, num_groups=1,
                      state_size=64, conv_window=4)
    return [Group("attention", attn, attn.with_(layout=decode_layout)), Group("mamba", mamba, mamba)]


def run_group(group: Group, prefill_tp: int, decode_tp: int, num_requests: int, blocks_per_request: int,
              rng: np.random.Generator) -> dict:
    """Plan and verify ``num_requests`` random requests of one group."""
    row = {"group": group.name, "layout": f"{group.prefill.layout}->{group.decode.layout}",
           "requests": 0, "verified_bytes": 0, "copied_bytes": 0, "spans": 0, "spans_unmerged": 0,
           "mismatches": []}
    start = time.perf_counter()
    for _ in range(num_requests):
        n = min(blocks_per_request, group.decode.num_blocks, group.prefill.num_blocks)
        decode_ids = rng.permutation(group.decode.num_blocks)[:n]
        # Prefill allocations are usually runs of consecutive blocks.
        first = int(rng.integers(0, group.prefill.num_blocks - n + 1))
        prefill_ids = np.arange(first, first + n)
        result = run_scenario(group.prefill, group.decode, prefill_tp, decode_tp, decode_ids, prefill_ids)
        row["requests"] += 1
        for key, value in (("verified_bytes", result.verified_bytes), ("copied_bytes", result.copied_bytes),
                           ("spans", result.num_spans), ("spans_unmerged", result.num_spans_unmerged)):
            row[key] += value
        row["mismatches"] += result.mismatches
    plans = result.reads
    row["reads"] = {f"decode {p.local_rank}": [f"p{r.remote_rank}:{r.field}[{r.slice.global_start}:{r.slice.global_stop})"
                                              for r in p.reads] for p in plans}
    row["notifiers_per_prefill_rank"] = [plans[0].pairing.num_notifiers(q) for q in range(prefill_tp)]
    row["seconds"] = time.perf_counter() - start
    return row


def format_rows(rows: list[dict]) -> str:
    head = (f"{'model':<7}{'P->D':<6}{'group':<15}{'layout':<24}{'reqs':>5}{'spans/req':>10}{'merged':>8}"
            f"{'MiB ok':>9}{'notify/P':>12}  result")
    lines = [head, "-" * len(head)]
    for row in rows:
        requests = max(row["requests"], 1)
        notify = ",".join(map(str, row["notifiers_per_prefill_rank"]))
        verdict = "byte-exact" if not row["mismatches"] else f"MISMATCH: {row['mismatches'][0]}"
        lines.append(f"{row['model']:<7}{row['pairing']:<6}{row['group']:<15}{row['layout']:<24}{row['requests']:>5}"
                     f"{row['spans_unmerged'] / requests:>10.1f}{row['spans'] / requests:>8.1f}"
                     f"{row['verified_bytes'] / 2**20:>9.1f}{notify:>12}  {verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS + ("all",), default="all", help="model preset (default: all)")
    parser.add_argument("--prefill-tp", type=int, help="prefill TP size (default: pairs 4->2 and 2->3)")
    parser.add_argument("--decode-tp", type=int, help="decode TP size")
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per logical block")
    parser.add_argument("--kernel-block-size", type=int, default=None, help="tokens per kernel block")
    parser.add_argument("--num-blocks", type=int, default=64, help="blocks per cache")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--blocks-per-request", type=int, default=12)
    parser.add_argument("--layout", choices=sorted(DECODE_LAYOUTS), default="packed",
                        help="decode-side attention layout (prefill is packed HND)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 when every byte matched, 1 otherwise, 2 on bad arguments."""
    if (args.prefill_tp is None) != (args.decode_tp is None):
        print("kvxferd demo: give both --prefill-tp and --decode-tp, or neither", file=sys.stderr)
        return 2
    for flag in ("requests", "blocks_per_request"):
        if getattr(args, flag) < 1:
            print(f"kvxferd demo: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    pairings = [(args.prefill_tp, args.decode_tp)] if args.prefill_tp is not None else [(4, 2), (2, 3)]
    models = MODELS if args.model == "all" else (args.model,)
    rng = np.random.default_rng(args.seed)
    rows = []
    try:
        for p, d in pairings:
            check_tp(p, 0, field="prefill_tp")
            check_tp(d, 0, field="decode_tp")
        for model in models:
            for p, d in pairings:
                for group in preset_groups(model, args):
                    row = run_group(group, p, d, args.requests, args.blocks_per_request, rng)
                    rows.append({"model": model, "pairing": f"{p}->{d}", **row})
    except KvxferError as err:
        print(f"kvxferd demo: {err}", file=sys.stderr)
        return 2
    summary = {
        "rows": rows,
        "verified_bytes": sum(r["verified_bytes"] for r in rows),
        "mismatched_groups": sum(bool(r["mismatches"]) for r in rows),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_rows(rows))
        print(f"\n{summary['verified_bytes'] / 2**20:.1f} MiB of decode caches verified; "
              f"{summary['mismatched_groups']} group(s) with mismatches.")
        print("spans/req: one span per block and region if unmerged; merged: after joining contiguous runs.")
    return 1 if summary["mismatched_groups"] else 0
