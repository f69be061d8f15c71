"""Through the daemons vs raw NIXL, in one run, on the same bytes.

    kvxferd bench daemon [--json]

Two ``kvxferd serve`` processes (prefill rank, decode rank) over loopback;
the engines' caches are shared memory owned by this process. The raw
baseline is a NIXL agent in this process, registered on the decode cache,
reading the prefill daemon's agent: the same bytes over the same
cross-process transport, without the daemons' control plane.

* bulk: one large request, alternating rounds: raw NIXL (make_prepped_xfer +
  transfer + poll on the plan's descriptors) vs the daemon path (SubmitRead
  -> post -> transfer -> holder ack -> completion on the stream, measured
  at the client). Ratio = daemon GB/s / raw GB/s.
* per-request overhead: small requests submitted at a steady rate
  (default 1 000/s), each held first. Per request: submit -> posted
  (daemon clock), completion -> delivered to the engine (wall clocks of
  one host), and submit -> delivered end to end; raw NIXL for the same
  request alone as the floor.
* mutual TLS: both measurements again with the daemons' peer ports on
  mutual TLS (a throw-away CA), plus the handshake time with and without;
  the modes run plain, TLS, TLS, plain and each figure is a mean of two.
  Bytes move over NIXL, never over gRPC, so TLS should cost the bulk
  nothing; it is paid at handshakes (GetEngineInfo over TLS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import grpc
import numpy as np

from kvxferd.bench.common import bench_main
from kvxferd.verify.certs import DevCA
from kvxferd.bench.raw import RawReader
from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.verify.daemons import DaemonCluster


class RawPath:
    """Raw NIXL from this process into the decode cache, reading the prefill daemon's agent (one request)."""

    def __init__(self, cluster: DaemonCluster, request: ReadRequest,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.reader = RawReader(cluster.decode[0].cache, cluster.prefill_id,
                                [d.peer_address for d in cluster.prefill_daemons], "raw-decode", credentials)
        self.prepared = self.reader.prepare(request)
        self.num_bytes = sum(num_bytes for *_, num_bytes in self.prepared)
        self.num_descriptors = sum(len(ids) for _, _, ids, _ in self.prepared)

    def read(self) -> float:
        return self.reader.read(self.prepared)

    def close(self) -> None:
        self.reader.release(self.prepared)
        self.reader.close()


BENCH_ID = "spiffe://kvxferd.bench/daemon"


class Tls:
    """A throw-away CA: the daemons' flags for mutual TLS, and a client certificate for the raw baseline."""

    def __init__(self, workdir: str) -> None:
        ca = DevCA(os.path.join(workdir, "pki"))
        issued = ca.issue("bench", dns_names=("kvxferd-peer",), spiffe_id=BENCH_ID)
        self.daemon_args = ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(ca.cert_path),
                            "--peer-allowed-ids", BENCH_ID)
        self.credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                                        issued.cert.read_bytes())


def _cluster(workdir: str, num_layers: int, num_blocks: int, name: str, tls: Tls | None) -> DaemonCluster:
    spec = AttentionSpec("packed_HND", num_blocks=num_blocks, num_kv_heads=8, head_size=128, block_size=16)
    groups = (CacheGroup("full", spec, num_layers),)
    return DaemonCluster(groups, groups, 1, 1, workdir=workdir, name=name, daemon_args=tls.daemon_args if tls else ())


def _credentials(tls: Tls | None):
    return tls.credentials if tls else None


def _daemon_read(cluster: DaemonCluster, request: ReadRequest) -> float:
    cluster.hold(request)
    start = time.perf_counter()
    cluster.submit(request)
    (completion,) = cluster.completions(request)
    elapsed = time.perf_counter() - start
    if not completion.ok:
        raise RuntimeError(f"daemon read failed: {completion.error}")
    return elapsed


def bulk(workdir: str, num_layers: int, num_blocks: int, rounds: int, tls: Tls | None = None) -> dict:
    """Alternate raw NIXL and the daemon path on one big request; also time repeated handshakes."""
    with _cluster(workdir, num_layers, num_blocks, "bulk", tls) as cluster:
        handshake_s = [cluster.decode_clients[0].handshake(cluster.prefill_id, [cluster.prefill_daemons[0].peer_address])
                       .duration_s for _ in range(max(rounds, 3))]
        ids = np.arange(num_blocks)
        request = ReadRequest("bulk-0", "bulk-0@p", (ids,), (ids,))
        raw = RawPath(cluster, request, _credentials(tls))
        try:
            raw_s, daemon_s = [], []
            for i in range(rounds + 1):  # round 0 warms both paths up
                raw_time = raw.read()
                name = f"bulk-{i}"
                daemon_time = _daemon_read(cluster, ReadRequest(name, f"{name}@p", (ids,), (ids,)))
                if i:
                    raw_s.append(raw_time)
                    daemon_s.append(daemon_time)
        finally:
            raw.close()
    raw_gbps, daemon_gbps = raw.num_bytes / statistics.median(raw_s) / 1e9, raw.num_bytes / statistics.median(daemon_s) / 1e9
    return {"bytes": raw.num_bytes, "descriptors": raw.num_descriptors, "rounds": rounds, "raw_gbps": raw_gbps,
            "daemon_gbps": daemon_gbps, "ratio": daemon_gbps / raw_gbps,
            "raw_ms": statistics.median(raw_s) * 1e3, "daemon_ms": statistics.median(daemon_s) * 1e3,
            "handshake_ms": statistics.median(handshake_s) * 1e3}


def _percentiles(values_s: list[float]) -> dict:
    values = np.asarray(values_s) * 1e6
    return {"p50_us": float(np.percentile(values, 50)), "p99_us": float(np.percentile(values, 99))}


def overhead(workdir: str, num_layers: int, blocks_per_request: int, rate_per_s: float, num_requests: int,
             tls: Tls | None = None) -> dict:
    """Small requests at a steady rate: where the daemon adds time."""
    num_blocks = 4 * blocks_per_request
    with _cluster(workdir, num_layers, num_blocks, "rate", tls) as cluster:
        rng = np.random.default_rng(0)
        requests = []
        for n in range(num_requests):
            ids = rng.permutation(num_blocks)[:blocks_per_request]
            requests.append(ReadRequest(f"q{n}", f"q{n}@p", (ids,), (np.sort(ids),)))
        raw = RawPath(cluster, requests[0], _credentials(tls))
        raw_s = [raw.read() for _ in range(200)][20:]
        raw.close()
        for request in requests:
            cluster.hold(request)
        client = cluster.decode_clients[0]
        submitted_unix, submit_call_s, calls = {}, [], []
        pids = {"decode daemon": cluster.decode_daemons[0].process.pid,
                "prefill daemon": cluster.prefill_daemons[0].process.pid, "engines (this process)": os.getpid()}
        cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        for n, request in enumerate(requests):
            wait_s = start + n / rate_per_s - time.perf_counter()
            if wait_s > 0:
                time.sleep(wait_s)
            submitted_unix[request.request_id] = time.time()
            # An engine does not wait for SubmitRead before its next step: send without blocking.
            calls.append(client.submit_read_async(request.request_id, cluster.prefill_id, request.remote_request_id,
                                                  request.local_block_ids, request.remote_block_ids))
        offered_s = time.perf_counter() - start
        for call in calls:
            call.result()
            submit_call_s.append(call.call_s)
        post_s, deliver_s, end_to_end_s, failed = [], [], [], 0
        for request in requests:
            completion, received_unix = client.wait_completion_timed(request.request_id, 60)
            failed += not completion.ok
            post_s.append(completion.post_s)
            deliver_s.append(received_unix - completion.done_unix_s)
            end_to_end_s.append(received_unix - submitted_unix[request.request_id])
        cpu_us = {name: (_cpu_s(pid) - cpu_before[name]) / num_requests * 1e6 for name, pid in pids.items()}
    return {"requests": num_requests, "rate_per_s": rate_per_s, "achieved_rate_per_s": num_requests / offered_s,
            "bytes_per_request": raw.num_bytes, "failed": failed, "submit_call": _percentiles(submit_call_s),
            "submit_to_posted": _percentiles(post_s), "completion_to_delivered": _percentiles(deliver_s),
            "end_to_end": _percentiles(end_to_end_s), "raw_nixl": _percentiles(raw_s), "cpu_us_per_request": cpu_us}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(rounds: int = 6, bulk_layers: int = 32, bulk_blocks: int = 256, rate_per_s: float = 1000.0,
        num_requests: int = 2000, rate_layers: int = 2, rate_blocks: int = 2, mtls: bool = True) -> dict:
    """Plain peer ports (``bulk``, ``overhead``) and, with ``mtls``, the same on mutual TLS (``mtls``).

    With ``mtls`` each mode runs twice, in the order plain, TLS, TLS, plain, and every figure is the
    mean of its two runs: on a shared 2-core machine a later run is often slower for reasons of its
    own, and the order cancels that out of the comparison.
    """
    with tempfile.TemporaryDirectory(prefix="kvxb") as workdir:
        def one(tls: Tls | None) -> dict:
            return {"bulk": bulk(workdir, bulk_layers, bulk_blocks, rounds, tls),
                    "overhead": overhead(workdir, rate_layers, rate_blocks, rate_per_s, num_requests, tls)}

        if not mtls:
            return one(None)
        tls = Tls(workdir)
        plain_1, tls_1, tls_2, plain_2 = one(None), one(tls), one(tls), one(None)
        return {**_mean(plain_1, plain_2), "mtls": _mean(tls_1, tls_2)}


def _mean(a, b):
    """Numbers averaged leaf by leaf; anything else taken from ``a``."""
    if isinstance(a, dict):
        return {key: _mean(value, b[key]) for key, value in a.items()}
    if isinstance(a, (int, float)) and not isinstance(a, bool) and a != b:
        return (a + b) / 2
    return a


def format_table(f: dict) -> str:
    text = _format_one(f)
    if "mtls" in f:
        b, t = f["bulk"], f["mtls"]["bulk"]
        o, p = f["overhead"]["end_to_end"], f["mtls"]["overhead"]["end_to_end"]
        text += ("\n\nwith mutual TLS on the peer ports:\n" + _format_one(f["mtls"]) +
                 f"\n\nmTLS vs plain: bulk ratio {t['ratio']:.3f} vs {b['ratio']:.3f}; end to end p50 "
                 f"{p['p50_us']:.0f} vs {o['p50_us']:.0f} us; handshake {t['handshake_ms']:.2f} vs {b['handshake_ms']:.2f} ms")
    return text


def _format_one(f: dict) -> str:
    b, o = f["bulk"], f["overhead"]
    lines = [f"bulk: {b['bytes'] / 2**20:.0f} MiB per request ({b['descriptors']} descriptors), P1->D1 daemons, "
             f"median of {b['rounds']} alternating rounds",
             f"  raw NIXL {b['raw_gbps']:.2f} GB/s ({b['raw_ms']:.1f} ms)   through daemons {b['daemon_gbps']:.2f} GB/s "
             f"({b['daemon_ms']:.1f} ms)   ratio {b['ratio']:.3f}   handshake {b['handshake_ms']:.2f} ms",
             "",
             f"per request: {o['requests']} requests of {o['bytes_per_request'] / 2**10:.0f} KiB offered at "
             f"{o['rate_per_s']:.0f}/s (achieved {o['achieved_rate_per_s']:.0f}/s), {o['failed']:g} failed",
             f"  {'':<34}{'p50 us':>9}{'p99 us':>9}"]
    for key, label in (("submit_call", "SubmitRead call (client)"), ("submit_to_posted", "submit -> posted (daemon)"),
                       ("completion_to_delivered", "completion -> delivered (engine)"),
                       ("end_to_end", "submit -> delivered (end to end)"), ("raw_nixl", "raw NIXL, same request alone")):
        lines.append(f"  {label:<34}{o[key]['p50_us']:>9.0f}{o[key]['p99_us']:>9.0f}")
    lines.append("  CPU per request: " + ", ".join(f"{name} {us:.0f} us" for name, us in o["cpu_us_per_request"].items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=6, help="alternating bulk rounds (default 6)")
    parser.add_argument("--bulk-layers", type=int, default=32, help="layers of the bulk request (64 KiB blocks)")
    parser.add_argument("--bulk-blocks", type=int, default=256, help="blocks per layer of the bulk request")
    parser.add_argument("--rate", type=float, default=1000.0, help="requests per second offered (default 1000)")
    parser.add_argument("--requests", type=int, default=2000, help="requests at that rate (default 2000)")
    parser.add_argument("--rate-layers", type=int, default=2, help="layers of each rate request (default 2)")
    parser.add_argument("--rate-blocks", type=int, default=2, help="64 KiB blocks per layer of each rate request")
    parser.add_argument("--no-mtls", action="store_true", help="skip the second run with mutual TLS on the peer ports")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run(args.rounds, args.bulk_layers, args.bulk_blocks, args.rate, args.requests, args.rate_layers,
                  args.rate_blocks, mtls=not args.no_mtls)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.bench.daemon", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
