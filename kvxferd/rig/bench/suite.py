"""``kvxferd bench``: every benchmark suite in one run, headline figures as a Markdown table.

    kvxferd bench [--quick] [--output FILE]

Runs ``layout`` (pure span emission and planning), ``xfer`` (the data plane
vs raw NIXL in one process) and ``daemon`` (through the daemons vs raw NIXL
across processes, its socket path: per-request overhead at a steady rate). Raw-NIXL
baselines are measured in the same run. ``--quick`` uses tiny sizes (a
smoke run: its figures mean little); each suite alone, with every size
option, is ``kvxferd bench <suite> --help``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

from kvxferd.rig.bench import daemon, layout, xfer

QUICK = {
    "layout": dict(num_layers=2, num_blocks=2000, repeat=1),
    "xfer": dict(rounds=1, bulk_layers=2, bulk_blocks=16, build_layers=2, build_blocks=200, planning_layers=2,
                 planning_blocks=20),
    "daemon": dict(sizes=dict(rounds=1, bulk_layers=2, bulk_blocks=32, num_requests_300=40, num_requests_1000=40,
                              idle_s=0.2)),
}


def _row(suite: str, measure: str, result: str, baseline: str = "", ratio: float | None = None) -> str:
    return f"| {suite} | {measure} | {result} | {baseline} | {'' if ratio is None else f'{ratio:.3f}'} |"


def _us(p: dict) -> str:
    return f"{p['p50_us']:.0f} / {p['p99_us']:.0f} µs"


def markdown(figures: dict, command: str, seconds: float) -> str:
    """The headline figures of every suite as one Markdown table."""
    lay, xf, dm = figures["layout"], figures["xfer"], figures["daemon"]
    lines = [f"`{command}` on {platform.machine()}, {os.cpu_count()} cores, "
             f"{datetime.date.today().isoformat()}, {seconds:.0f} s", "",
             "| suite | measure | result | raw NIXL, same run | ratio |", "|---|---|---|---|---|"]
    size = f"{lay['num_layers']} layers x {lay['num_blocks']:,} blocks"
    lines += [_row("layout", f"span emission, scattered ids ({size})", f"{lay['scattered']['mspans_per_s']:.0f} M spans/s"),
              _row("layout", "span emission, contiguous ids, merged", f"{lay['contiguous_merged']['mspans_per_s']:.0f} M spans/s"),
              _row("layout", "plan one region (narrow + match)", f"{lay['plan_region_reads_ms']:.2f} ms")]
    for label in ("contiguous", "scattered"):
        b = xf[f"bulk_{label}"]
        lines.append(_row("xfer", f"bulk read, {label} ids, {b['bytes'] / 2**20:.0f} MiB", f"{b['plan_gbps']:.2f} GB/s",
                          f"{b['raw_gbps']:.2f} GB/s", b["ratio"]))
    p = xf["plan_build"]
    lines.append(_row("xfer", f"plan build + agents + prepare ({p['num_layers']} layers x {p['num_blocks']:,} blocks)",
                      f"{p['connect_s'] * 1e3:.0f} ms"))
    worst = max(xf["request_planning"], key=lambda r: r["us"])
    lines.append(_row("xfer", f"request planning, {worst['pairing']} ({worst['descriptors']:,} descriptors)",
                      f"{worst['us']:.0f} µs"))
    b, o = dm["bulk"], dm["overhead"]
    lines += [_row("daemon", f"bulk read through the daemons, {b['bytes'] / 2**20:.0f} MiB", f"{b['daemon_gbps']:.2f} GB/s",
                   f"{b['raw_gbps']:.2f} GB/s", b["ratio"]),
              _row("daemon", f"end to end p50 / p99 at {o['rate_per_s']:.0f} req/s ({o['bytes_per_request'] / 2**10:.0f} KiB)",
                   _us(o["end_to_end"]), _us(o["raw_nixl"])),
              _row("daemon", "submit -> posted p50 / p99", _us(o["submit_to_posted"])),
              _row("daemon", "completion -> delivered p50 / p99", _us(o["completion_to_delivered"])),
              _row("daemon", "CPU per request, all processes", f"{sum(o['cpu_us_per_request'].values()):.0f} µs")]
    return "\n".join(lines) + "\n"


def run(quick: bool = False) -> dict:
    """Every suite's figures (quick sizes when ``quick``)."""
    sizes = QUICK if quick else {"layout": {}, "xfer": {}, "daemon": {}}
    # The table shows the daemon suite's socket path only: its other paths (the gRPC stream, same-host
    # copies, push, digests) are `kvxferd bench daemon`'s, and took two thirds of this run's time.
    return {"layout": layout.run(**sizes["layout"]), "xfer": xfer.run(**sizes["xfer"]),
            "daemon": daemon.run(**sizes["daemon"], grpc_stream=False, same_host=False, push=False, verify=False)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures to quote")
    parser.add_argument("--output", metavar="FILE", help="also write the Markdown table to FILE")


def run_args(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    figures = run(args.quick)
    table = markdown(figures, "kvxferd bench" + (" --quick" if args.quick else ""), time.perf_counter() - start)
    print(table, end="")
    if args.output:
        with open(args.output, "w") as out:
            out.write(table)
    return 0
