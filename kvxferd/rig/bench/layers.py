"""A push layer by layer vs one batch after the forward pass (issue #57), through real daemons.

    kvxferd bench layers [--json] [--quick]

One prefill and one decode daemon on loopback (real NIXL, gRPC, the reads socket), one rank each,
one full-attention group of 32 layers (64 KiB a block and layer). The prefill engine's forward pass is
played: a sleep of ``layer_ms`` per layer. Per request, after the decode rank's expectation reached
the prefill daemon:

* ``batch``: the forward pass runs, then the prefill engine holds the transfer (every layer final):
  the whole write goes after it (what a push does without layer reports);
* ``layered``: the prefill engine holds before its forward pass with no layer final, and says after
  each layer that it is (``FinalLayers`` on the reads socket): each stage goes while the next layer
  computes.

The figure is the **tail**: from the forward pass's end (its last layer final) to the decode rank's
completion, p50 over alternating rounds; what layer by layer saves is the batch's tail less the
layered one's. With no compute between layers (``layer_ms`` 0) it saves nothing and costs its
messages: where it pays depends on how long a layer computes against how long its KV takes to move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

NUM_LAYERS = 32
CASES = (  # (blocks per request: 64 KiB a block and layer, ms a layer computes)
    (4, 0.0), (4, 1.0), (64, 0.0), (64, 1.0), (64, 4.0))
QUICK_CASES = ((4, 1.0), (64, 1.0))


def _request(i: int, num_blocks: int):
    from kvxferd.plan.engine import ReadRequest

    ids = np.arange(num_blocks, dtype=np.int64)
    return ReadRequest(f"layers-{i}", f"layers-t{i}", (ids,), (ids + num_blocks,), num_blocks * 16)


def _one(cluster, request, layered: bool, layer_ms: float) -> float:
    """One push; its tail (s): the last layer final to the decode completion's arrival."""
    cluster.expect(request, deadline_s=30.0)
    time.sleep(0.02)  # the expectation reached the prefill daemon (as a concurrent dispatch gives it time to)
    if layered:
        cluster.hold(request, push=True, layers_final=[0])
    for layer in range(NUM_LAYERS):
        time.sleep(layer_ms / 1e3)
        if layered and layer < NUM_LAYERS - 1:
            cluster.final_layers(request, [layer + 1])
    ended_s = time.time()
    if layered:
        cluster.final_layers(request, [NUM_LAYERS])
    else:
        cluster.hold(request, push=True)
    (client,) = cluster.decode_clients
    completion, arrived_s = client.reads.wait_completion_timed(request.request_id, 30.0)
    if not completion.ok:
        raise RuntimeError(f"a {'layered' if layered else 'batch'} push failed: {completion.error}")
    return arrived_s - ended_s


def measure(cases=CASES, rounds: int = 10) -> list[dict]:
    """Per case: both tails' p50 (ms), the bytes per request and what layer by layer saved."""
    from kvxferd.rig.bench.common import full_attention_groups
    from kvxferd.rig.daemons import DaemonCluster

    rows = []
    max_blocks = max(b for b, _ in cases)
    groups = full_attention_groups(NUM_LAYERS, 2 * max_blocks)
    with tempfile.TemporaryDirectory(prefix="kvx-bench-layers") as workdir, \
            DaemonCluster(groups, groups, 1, 1, workdir=workdir, name="bench-layers") as cluster:
        n = 0
        for num_blocks, layer_ms in cases:
            tails: dict[str, list[float]] = {"batch": [], "layered": []}
            for i in range(rounds + 1):  # round 0 warms both paths up
                for layered in ((False, True) if i % 2 else (True, False)):
                    n += 1
                    tail = _one(cluster, _request(n, num_blocks), layered, layer_ms)
                    if i:
                        tails["layered" if layered else "batch"].append(tail)
            batch, layered = (statistics.median(tails[k]) * 1e3 for k in ("batch", "layered"))
            rows.append({"num_blocks": num_blocks, "layer_ms": layer_ms, "mib": num_blocks * NUM_LAYERS / 16,
                         "batch_tail_ms": round(batch, 3), "layered_tail_ms": round(layered, 3),
                         "saved_ms": round(batch - layered, 3), "rounds": rounds})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="two cases, 4 rounds each")


def run_args(args: argparse.Namespace) -> int:
    rows = measure(QUICK_CASES, 4) if args.quick else measure()
    if args.json:
        print(json.dumps({"num_layers": NUM_LAYERS, "cases": rows}, indent=2))
        return 0
    print(f"push tail after the forward pass, {NUM_LAYERS} layers, p50 of {rows[0]['rounds']} rounds (ms)")
    print(f"{'MiB':>6} {'ms/layer':>9} {'batch':>9} {'layered':>9} {'saved':>9}")
    for row in rows:
        print(f"{row['mib']:>6.0f} {row['layer_ms']:>9.1f} {row['batch_tail_ms']:>9.2f} {row['layered_tail_ms']:>9.2f} "
              f"{row['saved_ms']:>9.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvxferd.rig.bench.common import bench_main

    return bench_main("python -m kvxferd.rig.bench.layers", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
