"""Data-plane benchmark: plan path vs raw NIXL, plan build, per-request planning.

    python -m kvxferd.rig.bench.xfer          # or: kvxferd bench xfer [--json]

* bulk: one request's bytes moved (a) by raw NIXL calls on a descriptor list
  prepared for exactly that request and (b) through the plan
  (``ReadExecutor.read``: plan, make_prepped_xfer, transfer, poll, notices),
  alternating, on the same agents and memory. Ratio = plan / raw GB/s.
* plan build: 80 layers x 100 000 blocks, decode rank 0 of TP 2 reading
  prefill TP 4 (two remote ranks): plan + add agents + prepare lists.
* per-request planning: 1 000 blocks x 64 layers, block ids to descriptor ids.
* descriptors per request: posted (one per block, region and span) and after
  NIXL merges neighbours that are contiguous on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvxferd.rig.bench.common import bench_main, full_attention_groups, timed
from kvxferd.rig.bench.raw import prepare_raw, raw_read
from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.engine import EngineTransferPlan, ReadRequest
from kvxferd.plan.groups import CacheGroup, EngineCache, RegionMemory
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.rig import reading


def bulk(num_layers: int, num_blocks: int, blocks_per_request: int, rounds: int, scattered: bool, seed: int = 0) -> dict:
    """Alternate raw NIXL and the plan path on one request's descriptors."""
    groups = full_attention_groups(num_layers, num_blocks)
    prefill = allocate_engine("bench-prefill", groups, 1, 0, tagged=False)
    decode = allocate_engine("bench-decode", groups, 1, 0, tagged=False)
    prefill_agent = NixlAgent("bench-prefill-0")
    prefill_agent.register(prefill.cache)
    executor = ReadExecutor(NixlAgent("bench-decode-0"), decode.cache)
    with HolderThread([prefill_agent, executor.agent]) as pump:  # progress only: nothing is held
        remote = executor.connect([prefill.cache], [prefill_agent.metadata()])
        rng = np.random.default_rng(seed)
        local_ids = rng.permutation(num_blocks)[:blocks_per_request] if scattered else np.arange(blocks_per_request)
        request = ReadRequest("bulk", "bulk@prefill", (local_ids,), (np.arange(blocks_per_request),))
        planned = remote.plan.plan_request(request)
        read, rank_plan = planned.reads[0], remote.plan.rank_plans[0]
        # Raw: the very same descriptors, expanded and prepared for this request only.
        raw = executor.agent.raw
        raw_local, raw_remote, raw_ids = prepare_raw(raw, remote.agent_names[0], rank_plan, read)
        raw_s, plan_s = [], []
        for i in range(rounds + 1):  # round 0 warms both paths up
            start = time.perf_counter()
            raw_read(raw, raw_local, raw_remote, raw_ids, b"raw")
            raw_time = time.perf_counter() - start
            start = time.perf_counter()
            result = reading.read(executor, "bench-prefill", request)
            plan_time = time.perf_counter() - start
            if not result.ok:
                raise RuntimeError(f"plan read failed: {result.error}")
            if i:
                raw_s.append(raw_time)
                plan_s.append(plan_time)
        merged = planned.count_merged_descriptors()
        raw_local.release()
        raw_remote.release()
        executor.disconnect("bench-prefill")
        pump.stop()
    num_bytes = planned.num_bytes
    raw_gbs, plan_gbs = num_bytes / statistics.median(raw_s) / 1e9, num_bytes / statistics.median(plan_s) / 1e9
    return {"bytes": num_bytes, "posted_descriptors": read.num_descriptors, "merged_descriptors": merged,
            "raw_gbps": raw_gbs, "plan_gbps": plan_gbs, "ratio": plan_gbs / raw_gbs, "rounds": rounds}


def _cache(engine_id: str, spec: AttentionSpec, tp: int, rank: int, num_layers: int, memory=None) -> EngineCache:
    num_bytes = spec.region(tp, rank).num_bytes
    regions = memory or tuple(RegionMemory((i + 1) << 40, num_bytes) for i in range(num_layers))
    return EngineCache(engine_id, tp, rank, (CacheGroup("full", spec, num_layers),), (regions,))


def plan_build(num_layers: int = 80, num_blocks: int = 100_000) -> dict:
    """Plan + prepare for a decode rank reading two prefill ranks (real agents, real lists)."""
    # One byte per head and token keeps the memory behind 8 M descriptors small.
    spec = AttentionSpec("packed_HND", num_blocks=num_blocks, num_kv_heads=8, head_size=1, block_size=1, dtype="uint8")
    groups = (CacheGroup("full", spec, num_layers),)
    prefill = [allocate_engine("build-prefill", groups, 4, q, tagged=False) for q in range(4)]
    agents = [NixlAgent(f"build-prefill-{q}") for q in range(4)]
    for agent, engine in zip(agents, prefill):
        agent.register(engine.cache)
    decode = allocate_engine("build-decode", groups, 2, 0, tagged=False)
    executor = ReadExecutor(NixlAgent("build-decode-0"), decode.cache)
    caches, metadata = [e.cache for e in prefill], [a.metadata() for a in agents]
    plan_s, plan = timed(lambda: EngineTransferPlan(decode.cache, caches), 3)
    start = time.perf_counter()
    remote = executor.connect(caches, metadata)
    connect_s = time.perf_counter() - start
    num_descriptors = sum(int(rp.local_rows[:, 4].sum()) for rp in remote.plan.rank_plans)
    executor.disconnect("build-prefill")
    return {"num_layers": num_layers, "num_blocks": num_blocks, "read_ranks": [rp.remote_rank for rp in plan.rank_plans],
            "plan_s": plan_s, "connect_s": connect_s, "descriptors_per_side": num_descriptors,
            "rows_per_side": sum(len(rp.local_rows) for rp in plan.rank_plans)}


def request_planning(num_layers: int = 64, blocks_per_request: int = 1000, repeat: int = 300) -> list[dict]:
    """Median time of ``plan_request`` (pure) for homogeneous and heterogeneous TP."""
    spec = AttentionSpec("packed_HND", num_blocks=100_000, num_kv_heads=8, head_size=128, block_size=16)
    rng = np.random.default_rng(0)
    request = ReadRequest("r", "p", (rng.permutation(100_000)[:blocks_per_request],), (np.arange(blocks_per_request),))
    rows = []
    for p, d, r in ((1, 1, 0), (4, 2, 0), (2, 3, 1)):
        plan = EngineTransferPlan(_cache("d", spec, d, r, num_layers), [_cache("p", spec, p, q, num_layers) for q in range(p)])
        seconds, planned = timed(lambda: plan.plan_request(request), repeat)
        rows.append({"pairing": f"P{p}->D{d} rank {r}", "remote_ranks": len(planned.reads),
                     "descriptors": sum(x.num_descriptors for x in planned.reads), "us": seconds * 1e6})
    return rows


def run(rounds: int = 8, bulk_layers: int = 16, bulk_blocks: int = 256, build_layers: int = 80,
        build_blocks: int = 100_000, planning_layers: int = 64, planning_blocks: int = 1000) -> dict:
    """Every figure of this benchmark, as a dict (sizes overridable for quick runs)."""
    return {
        "bulk_contiguous": bulk(bulk_layers, 2 * bulk_blocks, bulk_blocks, rounds, scattered=False),
        "bulk_scattered": bulk(bulk_layers, 2 * bulk_blocks, bulk_blocks, rounds, scattered=True),
        "plan_build": plan_build(build_layers, build_blocks),
        "request_planning": request_planning(planning_layers, planning_blocks),
    }


def format_table(f: dict) -> str:
    b = f["bulk_contiguous"]
    lines = [f"bulk: {b['bytes'] / 2**20:.0f} MiB per request in 64 KiB blocks, P1->D1, median of "
             f"{b['rounds']} alternating rounds",
             f"{'ids':<12}{'posted':>8}{'merged':>8}{'raw GB/s':>10}{'plan GB/s':>11}{'ratio':>7}"]
    for label in ("contiguous", "scattered"):
        b = f[f"bulk_{label}"]
        lines.append(f"{label:<12}{b['posted_descriptors']:>8}{b['merged_descriptors']:>8}{b['raw_gbps']:>10.2f}"
                     f"{b['plan_gbps']:>11.2f}{b['ratio']:>7.3f}")
    p = f["plan_build"]
    lines += ["", f"plan build: {p['num_layers']} layers x {p['num_blocks']} blocks, decode 0/2 <- prefill TP 4 "
                  f"(reads ranks {p['read_ranks']}): plan {p['plan_s'] * 1e3:.1f} ms, plan + agents + prepare "
                  f"{p['connect_s'] * 1e3:.1f} ms ({p['rows_per_side']} strided rows for {p['descriptors_per_side']:,} descriptors per side)",
              "", f"{'per-request planning (block ids -> descriptor ids)':<48}{'ranks':>6}{'descriptors':>13}{'us':>8}"]
    for row in f["request_planning"]:
        lines.append(f"{row['pairing']:<48}{row['remote_ranks']:>6}{row['descriptors']:>13,}{row['us']:>8.0f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=8, help="alternating bulk rounds (default 8)")
    parser.add_argument("--bulk-layers", type=int, default=16, help="layers of the bulk request (default 16)")
    parser.add_argument("--bulk-blocks", type=int, default=256, help="64 KiB blocks per layer of the bulk request")
    parser.add_argument("--build-layers", type=int, default=80)
    parser.add_argument("--build-blocks", type=int, default=100_000)
    parser.add_argument("--planning-layers", type=int, default=64)
    parser.add_argument("--planning-blocks", type=int, default=1000)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run(args.rounds, args.bulk_layers, args.bulk_blocks, args.build_layers, args.build_blocks,
                  args.planning_layers, args.planning_blocks)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.xfer", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
