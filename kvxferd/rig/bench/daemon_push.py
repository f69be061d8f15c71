"""Push through the daemons (issue #57), next to the read: bulk and per-request cost, raw NIXL WRITE as the floor.

The raw baseline is a NIXL agent in this process registered on the prefill
cache (shared memory this process owns), WRITEing into the decode daemon's
agent: the same bytes over the same cross-process transport, without the
daemons. A push is timed from the prefill engine's ``Hold`` (what starts it:
the decode rank's expectation went out before, as a decode leg dispatched
with the prefill leg's would) to the decode engine's completion.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvxferd.plan.capability import push_key_digest
from kvxferd.plan.engine import ReadRequest
from kvxferd.rig.bench.common import percentiles_us
from kvxferd.rig.bench.daemon_paths import Tls, _cluster, _credentials
from kvxferd.rig.bench.raw import RawReader
from kvxferd.rig.daemons import DaemonCluster

POOL_REQUESTS = 32  # disjoint block sets the pushes at a steady rate take in turn
EXPECT_LEAD = 5  # requests whose expectations are out before their hold (at 300/s: about 17 ms ahead)


class RawWriter:
    """Raw NIXL WRITE from the prefill cache (registered in this process) into the decode daemon's agent."""

    def __init__(self, cluster: DaemonCluster, request: ReadRequest, credentials=None) -> None:
        self.writer = RawReader(cluster.prefill[0].cache, cluster.decode_id,
                                [d.peer_address for d in cluster.decode_daemons], "raw-prefill", credentials)
        # The writer's plan pairs its own spans with the decode rank's: the request seen from the prefill side.
        swapped = ReadRequest(request.request_id, request.remote_request_id, request.remote_block_ids,
                              request.local_block_ids, request.num_tokens)
        self.prepared = self.writer.prepare(swapped)
        self.num_bytes = sum(num_bytes for *_, num_bytes in self.prepared)

    def write(self) -> float:
        return self.writer.read(self.prepared, op="WRITE")

    def close(self) -> None:
        self.writer.release(self.prepared)
        self.writer.close()


def _expect(cluster: DaemonCluster, request: ReadRequest) -> None:
    cluster.expect(request)


def push_bulk(workdir: str, num_layers: int, num_blocks: int, rounds: int, tls: Tls | None = None, *,
              reads_socket: bool = True, same_host: bool = False) -> dict:
    """Alternate raw NIXL WRITE and a push through the daemons on one big request (``same_host``: the prefill
    daemon copies into the decode engine's memory; the raw floor stays a NIXL WRITE)."""
    with _cluster(workdir, num_layers, num_blocks, "pushbulk", tls, reads_socket, same_host) as cluster:
        ids = np.arange(num_blocks)
        raw = RawWriter(cluster, ReadRequest("raw", "raw@p", (ids,), (ids,)), _credentials(tls))
        try:
            raw_s, push_s = [], []
            for i in range(rounds + 1):  # round 0 warms both paths (and the push connection) up
                raw_time = raw.write()
                request = ReadRequest(f"pb-{i}", f"pb-{i}@p", (ids,), (ids,))
                _expect(cluster, request)
                time.sleep(0.05)  # the expectation is at the prefill daemon: the hold starts the write
                start = time.perf_counter()
                cluster.hold(request, push=True)
                (completion,) = cluster.completions(request)
                push_time = time.perf_counter() - start
                if not completion.ok:
                    raise RuntimeError(f"push failed: {completion.error}")
                if i:
                    raw_s.append(raw_time)
                    push_s.append(push_time)
            copies = cluster.prefill_daemons[0].metric("kvxferd_push_same_host_copies_total")
        finally:
            raw.close()
    raw_gbps, push_gbps = raw.num_bytes / statistics.median(raw_s) / 1e9, raw.num_bytes / statistics.median(push_s) / 1e9
    return {"bytes": raw.num_bytes, "rounds": rounds, "copies": copies, "raw_write_gbps": raw_gbps, "push_gbps": push_gbps,
            "ratio": push_gbps / raw_gbps, "raw_write_ms": statistics.median(raw_s) * 1e3,
            "push_ms": statistics.median(push_s) * 1e3}


def push_overhead(workdir: str, num_layers: int, blocks_per_request: int, rate_per_s: float, num_requests: int,
                  tls: Tls | None = None, *, reads_socket: bool = True, same_host: bool = False) -> dict:
    """Small pushes at a steady rate: each request's expectation goes out ahead, its hold at its arrival;
    hold -> the decode engine's completion, against a raw WRITE of the same request alone."""
    # Requests in flight together take disjoint decode blocks (a decode rank refuses a push naming blocks
    # another live push expects): POOL_REQUESTS sets, in turn, each in a random order. Over a slow link
    # (namespace hosts) more pushes are in flight than on loopback.
    num_blocks = POOL_REQUESTS * blocks_per_request
    with _cluster(workdir, num_layers, num_blocks, "pushrate", tls, reads_socket, same_host) as cluster:
        rng = np.random.default_rng(0)
        requests = []
        for n in range(num_requests):
            first = (n % POOL_REQUESTS) * blocks_per_request
            ids = first + rng.permutation(blocks_per_request)
            requests.append(ReadRequest(f"q{n}", f"q{n}@p", (ids,), (np.sort(ids),)))
        raw = RawWriter(cluster, requests[0], _credentials(tls))
        raw_s = [raw.write() for _ in range(200)][20:]
        raw.close()
        warm = ReadRequest("warm", "warm@p", requests[0].local_block_ids, requests[0].remote_block_ids)
        _expect(cluster, warm)  # the prefill daemon's connection to the decode rank is made here, not timed
        cluster.hold(warm, push=True)
        cluster.completions(warm)
        client, prefill = cluster.decode_clients[0], cluster.prefill_clients[0]
        for request in requests[:EXPECT_LEAD]:
            _expect(cluster, request)
        held_unix, failed = {}, 0
        digests = [push_key_digest(cluster.push_key(r.remote_request_id)) for r in requests]
        start = time.perf_counter()
        for n, request in enumerate(requests):
            wait_s = start + n / rate_per_s - time.perf_counter()
            if wait_s > 0:
                time.sleep(wait_s)
            if n + EXPECT_LEAD < num_requests:
                _expect(cluster, requests[n + EXPECT_LEAD])
            held_unix[request.request_id] = time.time()
            prefill.hold(request.remote_request_id, request.remote_block_ids, push_key_digest=digests[n])
        offered_s = time.perf_counter() - start
        end_to_end_s, errors = [], {}
        for request in requests:
            completion, received_unix = client.reads.wait_completion_timed(request.request_id, 60)
            failed += not completion.ok
            if not completion.ok:  # timed only when written (a refused one can complete before its hold)
                errors[completion.error] = errors.get(completion.error, 0) + 1
                continue
            end_to_end_s.append(received_unix - held_unix[request.request_id])
    if failed > num_requests // 100:  # a figure over what went through would hide what did not
        raise RuntimeError(f"{failed} of {num_requests} pushes at {rate_per_s:g}/s failed: {errors}")
    return {"requests": num_requests, "rate_per_s": rate_per_s, "achieved_rate_per_s": num_requests / offered_s,
            "bytes_per_request": raw.num_bytes, "failed": failed, "errors": errors, "end_to_end": percentiles_us(end_to_end_s),
            "raw_write": percentiles_us(raw_s)}


ALONE_GAP_S = 0.011  # expectation -> hold: a 64-token prefill's forward on this machine
ALONE_PAUSE_S = 1.5  # between pushes: both daemons idle again (their slowest polls), as between vLLM requests


def push_alone(workdir: str, num_requests: int, tls: Tls | None = None, *, reads_socket: bool = True,
               same_host: bool = False) -> dict:
    """One push at a time on idle daemons, in a vLLM push's order: the decode rank expects, the prefill
    engine holds ``ALONE_GAP_S`` later (its forward pass); hold -> the decode engine's completion, and with
    the hold first (expectation right after it)."""
    with _cluster(workdir, 2, 8, "pushalone", tls, reads_socket, same_host) as cluster:
        rng, seconds = np.random.default_rng(0), {"expect_first": [], "hold_first": []}
        for n in range(2 * num_requests + 2):  # the first of each order warms the connection up
            ids = rng.permutation(8)[:2]
            request = ReadRequest(f"a{n}", f"a{n}@p", (ids,), (np.sort(ids),))
            order = "expect_first" if n % 2 == 0 else "hold_first"
            if order == "expect_first":
                cluster.expect(request)
                time.sleep(ALONE_GAP_S)
            start = time.perf_counter()
            cluster.hold(request, push=True)
            if order == "hold_first":
                cluster.expect(request)
            (completion,) = cluster.completions(request)
            if not completion.ok:
                raise RuntimeError(f"push failed: {completion.error}")
            if n >= 2:
                seconds[order].append(time.perf_counter() - start)
            time.sleep(ALONE_PAUSE_S)
    return {order: percentiles_us(s) for order, s in seconds.items()}


def push_figures(workdir: str, sizes: dict, tls=None, *, same_host: bool = False) -> dict:
    """The push keys of ``kvxferd bench daemon``: ``push_bulk_ratio`` (vs raw NIXL WRITE on the same
    descriptors), ``push_p50_overhead_us_300`` (hold -> completion p50 minus the raw WRITE's) and
    ``push_alone_p50_us`` (one push at a time on idle daemons, hold -> completion). ``same_host``: the
    daemons prove one host and the pushes are copies (``same_host_writes``)."""
    b = push_bulk(workdir, sizes["bulk_layers"], sizes["bulk_blocks"], sizes["rounds"], tls, same_host=same_host)
    o300 = push_overhead(workdir, 2, 2, 300.0, sizes["num_requests_300"], tls, same_host=same_host)
    alone = push_alone(workdir, min(20, max(5, sizes["num_requests_300"] // 30)), tls, same_host=same_host)
    return {"push_bulk": b, "push_overhead": o300, "push_alone": alone, "push_bulk_ratio": b["ratio"],
            "push_p50_overhead_us_300": o300["end_to_end"]["p50_us"] - o300["raw_write"]["p50_us"],
            "push_alone_p50_us": alone["expect_first"]["p50_us"]}
