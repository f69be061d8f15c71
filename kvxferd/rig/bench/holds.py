"""How the prefill side's hold bookkeeping scales: 10 to 100,000 holds of one engine.

    kvxferd bench holds [--json]

For each number of outstanding holds, the cost per operation of ``Hold``,
``RenewLease``, ``Release``, a reader's notice (``record``) and lease expiry
(``expire``, ending a tenth of the holds), measured on the daemon's own
:class:`HoldTable`. Costs should stay flat (O(1)) or grow like log n
(expiry pops a heap); an expiry sweep ends at most ``max_ends`` holds, so a
burst never stalls the event loop.
"""

from __future__ import annotations

import argparse
import json
import time

from kvxferd.rig.bench.common import bench_main, timed
from kvxferd.plan.capability import HOLD_KEY_BYTES, hold_capability
from kvxferd.plan.leases import HoldTable
from kvxferd.plan.notifications import ReadNotice

SIZES = (10, 1_000, 10_000, 100_000)
LEASE_S = 30.0


def measure(num_holds: int) -> dict:
    """Nanoseconds per operation with ``num_holds`` holds outstanding."""
    table = HoldTable(bytes(HOLD_KEY_BYTES))
    ids = [f"r{n}" for n in range(num_holds)]
    start = time.perf_counter()
    for n, request_id in enumerate(ids):  # deadlines spread over 1 s, as holds arrive over time
        table.hold(request_id, ((n,),), LEASE_S + n / num_holds, 0.0)
    hold_ns = (time.perf_counter() - start) / num_holds * 1e9
    start = time.perf_counter()
    table.renew(ids, LEASE_S, 1.0)
    renew_ns = (time.perf_counter() - start) / num_holds * 1e9
    tenth = max(1, num_holds // 10)
    capabilities = [hold_capability(table.hold_key, request_id, ((n,),)) for n, request_id in enumerate(ids[:tenth])]
    start = time.perf_counter()
    for request_id, capability in zip(ids[:tenth], capabilities):  # one reader each: CONSUMED
        table.record(ReadNotice(request_id, "reader", 0, 1, capability=capability), 1.0, 1)
    record_ns = (time.perf_counter() - start) / tenth * 1e9
    start = time.perf_counter()
    for request_id in ids[tenth:2 * tenth]:
        table.release(request_id)
    release_ns = (time.perf_counter() - start) / tenth * 1e9
    idle_tick_s, nothing_due = timed(lambda: table.expire(2.0), 101)  # ticks that end nothing
    idle_tick_ns = idle_tick_s * 1e9
    # Renewed at 1.0 for LEASE_S: the first ones are due at 31.0 + their spread.
    due_s = 1.0 + LEASE_S + 0.3
    start = time.perf_counter()
    ended = table.expire(due_s)
    expire_ns = (time.perf_counter() - start) / max(1, len(ended)) * 1e9
    if nothing_due:
        raise RuntimeError(f"a sweep before any lease ran out ended {len(nothing_due)} holds")
    return {"holds": num_holds, "hold_ns": hold_ns, "renew_ns": renew_ns, "record_ns": record_ns,
            "release_ns": release_ns, "expire_ns_per_end": expire_ns, "expired": len(ended),
            "idle_tick_us": idle_tick_ns / 1e3}


def run(sizes=SIZES) -> dict:
    return {"sizes": [measure(n) for n in sizes]}


def format_table(figures: dict) -> str:
    lines = [f"{'holds':>8}{'Hold':>9}{'Renew':>9}{'notice':>9}{'Release':>9}{'expire':>9}{'idle tick':>11}",
             f"{'':>8}{'ns/op':>9}{'ns/id':>9}{'ns/op':>9}{'ns/op':>9}{'ns/end':>9}{'us':>11}"]
    for f in figures["sizes"]:
        lines.append(f"{f['holds']:>8,}{f['hold_ns']:>9.0f}{f['renew_ns']:>9.0f}{f['record_ns']:>9.0f}"
                     f"{f['release_ns']:>9.0f}{f['expire_ns_per_end']:>9.0f}{f['idle_tick_us']:>11.1f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run()
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.holds", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
