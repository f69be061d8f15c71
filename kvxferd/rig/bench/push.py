"""Push vs pull on the data plane (issue #57): one request written vs read, each against raw NIXL.

    python -m kvxferd.rig.bench.push          # or: kvxferd bench push [--json] [--ucx-tls tcp]

In one process, P1 -> D1, each rank its own NIXL agent (UCX, loopback):

* raw READ and raw WRITE: the request's very descriptors, prepared for it alone, one
  make_prepped_xfer + transfer + poll (the floor of each direction);
* kvxferd read: the decode rank's executor reads a held request (board check before and
  after, notice; the holder thread counts it) until the hold ends CONSUMED;
* kvxferd push: the decode rank expects the request (a hold of its blocks), the prefill
  rank's push executor checks the decode board, WRITEs, checks again and notifies, until
  the expectation ends CONSUMED.

Rounds alternate the four; medians. ``small`` is one request of 16 layers x 4 blocks
(4 MiB), ``bulk`` 16 layers x 256 blocks (256 MiB). Ratios are kvxferd / raw of the same
direction; overheads kvxferd - raw in µs. Daemons are not in this path (their figures:
``kvxferd bench daemon``); the push path through daemons is not built yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def _measure(num_layers: int, num_blocks: int, rounds: int) -> dict:
    from kvxferd.plan.engine import ReadRequest
    from kvxferd.rig.bench.common import full_attention_groups
    from kvxferd.rig.bench.raw import read_all
    from kvxferd.rig.verify.cluster import LocalCluster
    from kvxferd.rig.verify.pushcluster import PushCluster

    groups = full_attention_groups(num_layers, 2 * num_blocks)
    request = ReadRequest("bench", "bench@prefill", (np.arange(num_blocks),), (np.arange(num_blocks) + num_blocks,))
    times = {"raw_read": [], "raw_write": [], "read": [], "push": []}
    with LocalCluster(groups, groups, 1, 1, name="bench-pull") as pull, \
            PushCluster(groups, groups, 1, 1, name="bench-push") as push:
        executor = pull.executors[0]
        read_raw = _raw_lists(executor.agent.raw, executor.remote(pull.prefill_id), request, reading=True)
        pusher = push.pushers[0]
        write_raw = _raw_lists(pusher.agent.raw, pusher.target(push.decode_id, 0), request, reading=False)
        num_bytes = 0
        for i in range(rounds + 1):  # round 0 warms every path up
            start = time.perf_counter()
            read_all([read_raw])
            raw_read_s = time.perf_counter() - start
            start = time.perf_counter()
            _write_all(write_raw)
            raw_write_s = time.perf_counter() - start
            start = time.perf_counter()
            results = pull.read(request)
            end = pull.holder_thread.wait_end(0, request.remote_request_id, timeout_s=30)
            read_s = time.perf_counter() - start
            start = time.perf_counter()
            results += push.push(request, push.expect(request))
            end_push = push.holder_thread.wait_end(0, request.remote_request_id, timeout_s=30)
            push_s = time.perf_counter() - start
            if not all(r.ok for r in results) or end is None or end_push is None or end_push.failed_readers:
                raise RuntimeError(f"a round failed: {[r.error for r in results]}, ends {end}, {end_push}")
            num_bytes = results[0].num_bytes
            if i:
                for key, value in zip(times, (raw_read_s, raw_write_s, read_s, push_s)):
                    times[key].append(value)
        if push.check(request):
            raise RuntimeError("the pushed bytes differ from the oracle")
        for handle in (*read_raw[1:3], *write_raw[1:3]):
            handle.release()
    medians = {key: statistics.median(values) for key, values in times.items()}
    gbps = {key: num_bytes / s / 1e9 for key, s in medians.items()}
    return {"bytes": num_bytes, "rounds": rounds, **{f"{k}_us": v * 1e6 for k, v in medians.items()},
            **{f"{k}_gbps": v for k, v in gbps.items()},
            "read_ratio": gbps["read"] / gbps["raw_read"], "push_ratio": gbps["push"] / gbps["raw_write"],
            "read_overhead_us": (medians["read"] - medians["raw_read"]) * 1e6,
            "push_overhead_us": (medians["push"] - medians["raw_write"]) * 1e6}


def _raw_lists(raw_agent, connection, request, *, reading: bool):
    """(agent, local list, remote list, ids) holding exactly the request's descriptors of the connection."""
    from kvxferd.plan.descriptors import expand_rows
    from kvxferd.plan.push import PushRequest

    if reading:
        rank_plan = connection.plan.rank_plans[0]
        move = connection.plan.plan_request(request).reads[0]
        local_rows, remote_rows, name = rank_plan.local_rows, rank_plan.remote_rows, connection.agent_names[0]
    else:
        plan = connection.plans[0]
        move = plan.plan_request(PushRequest(request.remote_request_id, request.local_block_ids,
                                             request.remote_block_ids, bytes(16), request.num_tokens)).write
        local_rows, remote_rows, name = plan.writer_rows, plan.target_rows, connection.agent_names[0]
    descs = []
    for rows, ids in ((local_rows, move.local_ids), (remote_rows, move.remote_ids)):
        addresses, lengths = expand_rows(rows)
        descs.append(np.stack([addresses[ids], lengths[ids], np.zeros(len(ids), np.int64)], axis=1).astype(np.uint64))
    local = raw_agent.prep_xfer_dlist("", descs[0], "DRAM")
    remote = raw_agent.prep_xfer_dlist(name, descs[1], "DRAM")
    return raw_agent, local, remote, np.arange(len(move.local_ids), dtype=np.int32)


def _write_all(lists) -> None:
    agent, local, remote, ids = lists
    handle = agent.make_prepped_xfer("WRITE", local, ids, remote, ids, b"")
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"raw NIXL WRITE ended {state}")


def run(rounds: int = 8, small_blocks: int = 4, bulk_blocks: int = 256, num_layers: int = 16) -> dict:
    """Every figure of this benchmark, as a dict."""
    small = _measure(num_layers, small_blocks, rounds * 4)
    bulk = _measure(num_layers, bulk_blocks, rounds)
    return {"ucx_tls": os.environ.get("UCX_TLS", ""), "small": small, "bulk": bulk,
            "push_bulk_ratio": bulk["push_ratio"], "read_bulk_ratio": bulk["read_ratio"],
            "push_p50_overhead_us_small": small["push_overhead_us"],
            "read_p50_overhead_us_small": small["read_overhead_us"]}


def format_table(f: dict) -> str:
    lines = [f"push vs pull, P1->D1, one process, UCX_TLS={f['ucx_tls'] or '(default)'}",
             f"{'request':<8}{'MiB':>6}{'raw READ':>10}{'read':>9}{'raw WRITE':>11}{'push':>9}"
             f"{'read ratio':>12}{'push ratio':>12}{'read +us':>10}{'push +us':>10}"]
    for label in ("small", "bulk"):
        s = f[label]
        lines.append(f"{label:<8}{s['bytes'] / 2**20:>6.0f}{s['raw_read_us']:>8.0f}us{s['read_us']:>7.0f}us"
                     f"{s['raw_write_us']:>9.0f}us{s['push_us']:>7.0f}us{s['read_ratio']:>12.3f}{s['push_ratio']:>12.3f}"
                     f"{s['read_overhead_us']:>10.0f}{s['push_overhead_us']:>10.0f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=8, help="alternating bulk rounds (small: 4x as many)")
    parser.add_argument("--small-blocks", type=int, default=4, help="64 KiB blocks per layer, small request")
    parser.add_argument("--bulk-blocks", type=int, default=256, help="64 KiB blocks per layer, bulk request")
    parser.add_argument("--ucx-tls", default=None, help="UCX_TLS for this run (e.g. tcp), set before NIXL loads")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    figures = run(args.rounds, args.small_blocks, args.bulk_blocks)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvxferd.rig.bench.common import bench_main

    return bench_main("python -m kvxferd.rig.bench.push", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
