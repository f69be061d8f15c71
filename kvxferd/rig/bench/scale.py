"""How the per-request cost grows: remote ranks per read, and offered rate.

    kvxferd bench scale [--quick] [--json]

* ranks: one decode rank (TP 1) reads a request from a prefill engine of
  TP 1, 2, 4, 8 and 16 (16 KV heads, so each prefill rank owns 16/P of
  them): the same bytes, split over P remote ranks and P times as many
  descriptors. In one process over UCX loopback, per read: planning alone,
  the read through the daemon's executor (plan + post per rank + poll to
  the end), and raw NIXL posting the same descriptors (prepared for that
  request beforehand) and polling them. Medians, alternating.
* rates: through the daemons (``kvxferd serve`` pair, the Reads stream),
  256 KiB requests at rising offered rates until the two cores saturate;
  with one read per engine step and with several (an engine step submits
  every read it schedules as one batch). p50/p99 end to end and CPU per
  request of each process at each rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

from kvxferd.rig.bench.common import bench_main
from kvxferd.rig.bench.daemon_paths import overhead
from kvxferd.rig.bench.raw import prepare_raw, read_all
from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.rig.reading import wait
from kvxferd.xfer.admission import admit

RANKS = (1, 2, 4, 8, 16)
RATES = (300, 1000, 2000, 3000, 5000)
QUICK_RATES = (300, 1000, 3000)


def ranks_row(prefill_tp: int, num_layers: int, blocks_per_request: int, rounds: int) -> dict:
    """One decode rank reading one request from ``prefill_tp`` remote ranks."""
    spec = AttentionSpec("packed_HND", num_blocks=4 * blocks_per_request, num_kv_heads=16, head_size=128,
                         block_size=16)
    groups = (CacheGroup("full", spec, num_layers),)
    prefill = [allocate_engine("scale-prefill", groups, prefill_tp, q, tagged=False) for q in range(prefill_tp)]
    agents = [NixlAgent(f"scale-prefill-{q}") for q in range(prefill_tp)]
    for agent, engine in zip(agents, prefill):
        agent.register(engine.cache)
    decode = allocate_engine("scale-decode", groups, 1, 0, tagged=False)
    executor = ReadExecutor(NixlAgent("scale-decode-0"), decode.cache)
    with HolderThread([*agents, executor.agent], interval_s=100e-6):  # progress only: nothing is held
        remote = executor.connect([e.cache for e in prefill], [a.metadata() for a in agents])
        rng = np.random.default_rng(prefill_tp)
        request = ReadRequest("r", "r@p", (rng.permutation(spec.num_blocks)[:blocks_per_request],),
                              (np.arange(blocks_per_request),))
        planned = remote.plan.plan_request(request)
        rank_plans = {rp.remote_rank: rp for rp in remote.plan.rank_plans}
        raw = [(executor.agent.raw, *prepare_raw(executor.agent.raw, remote.agent_names[read.remote_rank],
                                                 rank_plans[read.remote_rank], read)) for read in planned.reads]
        plan_s, daemon_s, raw_s = [], [], []
        for i in range(rounds + 10):  # 10 warm-up rounds
            start = time.perf_counter()
            remote.plan.plan_request(request)
            plan_time = time.perf_counter() - start
            raw_time = read_all(raw)
            start = time.perf_counter()
            result = wait(executor, executor.post(admit(remote, request)))
            daemon_time = time.perf_counter() - start
            if not result.ok:
                raise RuntimeError(f"read from {prefill_tp} ranks failed: {result.error}")
            if i >= 10:
                plan_s.append(plan_time)
                raw_s.append(raw_time)
                daemon_s.append(daemon_time)
        for _, local, remote_list, _ in raw:
            local.release()
            remote_list.release()
        executor.disconnect("scale-prefill")
    for agent, engine in zip(agents, prefill):
        agent.deregister(engine.cache.engine_id)
    us = {name: statistics.median(values) * 1e6 for name, values in
          (("plan_us", plan_s), ("read_us", daemon_s), ("raw_us", raw_s))}
    return {"remote_ranks": len(planned.reads), "bytes": planned.num_bytes,
            "descriptors": sum(r.num_descriptors for r in planned.reads), **us,
            "overhead_us": us["read_us"] - us["raw_us"]}


def rates(workdir: str, rates_per_s: tuple[int, ...], seconds: float, reads_per_step: tuple[int, ...]) -> list[dict]:
    """The Reads stream at each offered rate, for each batch size; stops a batch size once saturated."""
    rows = []
    for per_step in reads_per_step:
        for rate in rates_per_s:
            o = overhead(workdir, 2, 2, float(rate), max(int(rate * seconds), 200), reads_per_step=per_step)
            rows.append({"reads_per_step": per_step, "rate_per_s": rate, "achieved_rate_per_s": o["achieved_rate_per_s"],
                         "completed_rate_per_s": o["completed_rate_per_s"], "failed": o["failed"],
                         "p50_us": o["end_to_end"]["p50_us"], "p99_us": o["end_to_end"]["p99_us"],
                         "cpu_us_per_request": o["cpu_us_per_request"]})
            if o["completed_rate_per_s"] < 0.9 * rate:
                break  # saturated: higher rates only grow the queues
    return rows


def run(quick: bool = False) -> dict:
    layers, blocks, rounds = (4, 16, 30) if quick else (8, 32, 100)
    figures = {"ranks": [ranks_row(p, layers, blocks, rounds) for p in RANKS]}
    with tempfile.TemporaryDirectory(prefix="kvxs") as workdir:
        figures["rates"] = rates(workdir, QUICK_RATES if quick else RATES, 1.5 if quick else 4.0, (1, 8))
    return figures


def format_table(f: dict) -> str:
    r0 = f["ranks"][0]
    lines = [f"remote ranks per read: one decode rank, {r0['bytes'] / 2**10:.0f} KiB per request, in-process "
             f"(median us)", f"{'ranks':>6}{'descriptors':>13}{'plan':>8}{'read':>8}{'raw NIXL':>10}{'overhead':>10}"]
    for r in f["ranks"]:
        lines.append(f"{r['remote_ranks']:>6}{r['descriptors']:>13}{r['plan_us']:>8.0f}{r['read_us']:>8.0f}"
                     f"{r['raw_us']:>10.0f}{r['overhead_us']:>10.0f}")
    lines += ["", "offered rate through the daemons (Reads stream, 256 KiB requests); CPU us per request",
              f"{'per step':>9}{'offered':>9}{'done/s':>8}{'p50 us':>9}{'p99 us':>10}{'decode':>8}{'prefill':>8}"
              f"{'engine':>8}"]
    for r in f["rates"]:
        cpu = r["cpu_us_per_request"]
        lines.append(f"{r['reads_per_step']:>9}{r['rate_per_s']:>9}{r['completed_rate_per_s']:>8.0f}{r['p50_us']:>9.0f}"
                     f"{r['p99_us']:>10.0f}{cpu['decode daemon']:>8.0f}{cpu['prefill daemon']:>8.0f}"
                     f"{cpu['engines (this process)']:>8.0f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer rounds and rates (about a minute)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run(quick=args.quick)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.scale", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
