"""The measurements of ``kvxferd bench daemon``: one daemon pair per measurement, raw NIXL beside it.

Each reads through the engine's Reads session (batches in, numbered
completions out), over the daemon's reads socket or, with
``reads_socket=False``, the gRPC ``Reads`` stream. Both are measured the same
way in one run.
"""

from __future__ import annotations

import functools
import glob
import os
import statistics
import time

import grpc
import numpy as np

from kvxferd.rig.daemons import dataplane_workers
from kvxferd.rig.bench.common import full_attention_groups, percentiles_us
from kvxferd.rig.bench.raw import RawReader
from kvxferd.plan.engine import ReadRequest
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.client import DaemonProcess


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


BENCH_ID = "spiffe://kvxferd.rig.bench/daemon"


class Tls:
    """A throw-away CA: the daemons' flags for mutual TLS, and a client certificate for the raw baseline."""

    def __init__(self, workdir: str) -> None:
        ca = DevCA(os.path.join(workdir, "pki"))
        issued = ca.issue("bench", dns_names=("kvxferd-peer",), spiffe_id=BENCH_ID)
        self.daemon_args = ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(ca.cert_path),
                            "--peer-allowed-ids", BENCH_ID)
        self.credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                                        issued.cert.read_bytes())


def _cluster(workdir: str, num_layers: int, num_blocks: int, name: str, tls: Tls | None,
             reads_socket: bool = True, same_host: bool = False, env: dict | None = None) -> DaemonCluster:
    groups = full_attention_groups(num_layers, num_blocks)
    args = (*(tls.daemon_args if tls else ()),
            *(() if same_host else ("--no-same-host-reads",)))  # NIXL's figures unless same-host is asked for
    start_many = functools.partial(DaemonProcess.start_many, env=env) if env else getattr(tls, "start_many", None)
    return DaemonCluster(groups, groups, 1, 1, workdir=workdir, name=name, daemon_args=args,
                         reads_socket=reads_socket, start_many=start_many)


def _credentials(tls: Tls | None):
    return tls.credentials if tls else None


def _daemon_read(cluster: DaemonCluster, request: ReadRequest, verify: bool = False, hold_s: list | None = None) -> float:
    """One read through the daemons (``verify``: with the hold's digests, checked); the time of the hold goes
    to ``hold_s``."""
    start = time.perf_counter()
    cluster.hold(request, want_digests=verify)
    if hold_s is not None:
        hold_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    cluster.submit(request, digests=verify)
    (completion,) = cluster.completions(request)
    elapsed = time.perf_counter() - start
    if not completion.ok:
        raise RuntimeError(f"daemon read failed: {completion.error}")
    return elapsed


def bulk(workdir: str, num_layers: int, num_blocks: int, rounds: int, tls: Tls | None = None, *,
         reads_socket: bool = True, same_host: bool = False, verify: bool = False) -> dict:
    """Alternate raw NIXL and the daemon path on one big request; also time repeated handshakes.
    ``same_host``: the decode daemon copies from the prefill engine's shared memory (issue #37); ``verify``:
    every daemon read carries its hold's digests (issue #59; the hold's own time: ``hold_ms``)."""
    with _cluster(workdir, num_layers, num_blocks, "bulk", tls, reads_socket, same_host) as cluster:
        handshake_s = [cluster.decode_clients[0].handshake(cluster.prefill_id, [cluster.prefill_daemons[0].peer_address])
                       .duration_s for _ in range(max(rounds, 3))]
        ids = np.arange(num_blocks)
        request = ReadRequest("bulk-0", "bulk-0@p", (ids,), (ids,))
        raw = RawPath(cluster, request, _credentials(tls))
        try:
            raw_s, daemon_s, hold_s = [], [], []
            for i in range(rounds + 1):  # round 0 warms both paths up
                raw_time = raw.read()
                name = f"bulk-{i}"
                daemon_time = _daemon_read(cluster, ReadRequest(name, f"{name}@p", (ids,), (ids,)), verify, hold_s)
                if i:
                    raw_s.append(raw_time)
                    daemon_s.append(daemon_time)
        finally:
            raw.close()
    raw_gbps, daemon_gbps = raw.num_bytes / statistics.median(raw_s) / 1e9, raw.num_bytes / statistics.median(daemon_s) / 1e9
    return {"bytes": raw.num_bytes, "descriptors": raw.num_descriptors, "rounds": rounds, "raw_gbps": raw_gbps,
            "daemon_gbps": daemon_gbps, "ratio": daemon_gbps / raw_gbps,
            "raw_ms": statistics.median(raw_s) * 1e3, "daemon_ms": statistics.median(daemon_s) * 1e3,
            "handshake_ms": statistics.median(handshake_s) * 1e3, "hold_ms": statistics.median(hold_s[1:]) * 1e3}


def overhead(workdir: str, num_layers: int, blocks_per_request: int, rate_per_s: float, num_requests: int,
             tls: Tls | None = None, *, reads_socket: bool = True, idle_s: float = 0.0,
             reads_per_step: int = 1, same_host: bool = False, verify: bool = False, otel=None) -> dict:
    """Small requests at a steady rate: where the daemon adds time (``verify``: each read checked against its
    hold's digests, issue #59; ``otel``: a :class:`kvxferd.rig.otlp.SpanReceiver` the daemons send their
    OpenTelemetry spans to, every request traced, issue #60).

    With ``idle_s``, first the daemons' CPU while engines are registered and nothing happens.
    ``reads_per_step``: the engine submits that many reads as one batch, as a
    step that scheduled them would; end to end counts from the batch's submission.
    """
    num_blocks = 4 * blocks_per_request
    env = otel.environment() if otel is not None else None
    trace_id = os.urandom(16).hex()
    traceparents = {}
    with _cluster(workdir, num_layers, num_blocks, "rate", tls, reads_socket, same_host, env) as cluster:
        rng = np.random.default_rng(0)
        requests = []
        for n in range(num_requests):
            ids = rng.permutation(num_blocks)[:blocks_per_request]
            requests.append(ReadRequest(f"q{n}", f"q{n}@p", (ids,), (np.sort(ids),)))
            traceparents[f"q{n}"] = f"00-{trace_id}-{n + 1:016x}-01" if otel is not None else ""
        raw = RawPath(cluster, requests[0], _credentials(tls))
        raw_s = [raw.read() for _ in range(200)][20:]
        raw.close()
        pids = {"decode daemon": cluster.decode_daemons[0].process.pid,
                "prefill daemon": cluster.prefill_daemons[0].process.pid, "engines (this process)": os.getpid()}
        idle = _idle_cpu_percent(pids, idle_s) if idle_s else {}
        for request in requests:
            cluster.hold(request, want_digests=verify, traceparent=traceparents[request.request_id])
        client = cluster.decode_clients[0]
        submitted_unix = {}
        cpu_before = {name: _cpu_s(pid) for name, pid in pids.items()}
        workers_before = {name: _workers_cpu_s(pid) for name, pid in pids.items() if "daemon" in name}
        per_step = reads_per_step
        start, start_unix = time.perf_counter(), time.time()
        for n in range(0, num_requests, per_step):
            step = requests[n:n + per_step]
            wait_s = start + (n + len(step) - 1) / rate_per_s - time.perf_counter()  # the step's last arrival
            if wait_s > 0:
                time.sleep(wait_s)
            now_unix = time.time()
            submitted_unix.update((request.request_id, now_unix) for request in step)
            # An engine does not wait for the daemon before its next step: send without blocking.
            client.reads.submit_reads([client.read_spec(r.request_id, cluster.prefill_id, r.remote_request_id,
                                                        r.local_block_ids, r.remote_block_ids,
                                                        remote_capabilities=cluster.capabilities[r.remote_request_id],
                                                        remote_digests=cluster.digests[r.remote_request_id] if verify else (),
                                                        traceparent=traceparents[r.request_id])
                                       for r in step])
        offered_s = time.perf_counter() - start
        post_s, deliver_s, end_to_end_s, failed, last_unix = [], [], [], 0, start_unix
        stages_s = {"plan": [], "transfer": [], "check": []}
        for request in requests:
            completion, received_unix = client.reads.wait_completion_timed(request.request_id, 60)
            failed += not completion.ok
            post_s.append(completion.post_s)
            for stage, values in stages_s.items():
                values.append(getattr(completion, f"{stage}_s"))
            deliver_s.append(received_unix - completion.done_unix_s)
            end_to_end_s.append(received_unix - submitted_unix[request.request_id])
            last_unix = max(last_unix, received_unix)
        cpu_us = {name: (_cpu_s(pid) - cpu_before[name]) / num_requests * 1e6 for name, pid in pids.items()}
        workers_us = {name: (_workers_cpu_s(pids[name]) - before) / num_requests * 1e6
                      for name, before in workers_before.items()}
    spans = {}
    if otel is not None:  # (the daemons flushed their last spans when they stopped)
        received = otel.spans(trace_id)
        spans = {name: sum(s.name == name for s in received) for name in ("kvxferd.hold", "kvxferd.read")}
    return {"requests": num_requests, "rate_per_s": rate_per_s, "achieved_rate_per_s": num_requests / offered_s,
            "reads_per_step": per_step, "completed_rate_per_s": (num_requests - failed) / max(last_unix - start_unix, 1e-9),
            "bytes_per_request": raw.num_bytes, "failed": failed,
            "submit_to_posted": percentiles_us(post_s), "completion_to_delivered": percentiles_us(deliver_s),
            **{f"daemon_{stage}": percentiles_us(values) for stage, values in stages_s.items()},
            "end_to_end": percentiles_us(end_to_end_s), "raw_nixl": percentiles_us(raw_s), "cpu_us_per_request": cpu_us,
            "workers_cpu_us_per_request": workers_us, "idle_cpu_percent": idle, "spans_received": spans}


def _idle_cpu_percent(pids: dict, idle_s: float) -> dict:
    """Per-daemon CPU (its workers' included) over ``idle_s`` seconds of nothing to do, in percent of one
    core. Counted in nanoseconds (``schedstat``): the clock ticks of ``/proc/<pid>/stat`` are 10 ms, 0.2 %
    of a core over 5 s, as coarse as the 0.5 % target itself."""
    time.sleep(0.5)  # registration and handshake settle
    daemons = {name: pid for name, pid in pids.items() if "daemon" in name}
    before, start = {name: _idle_cpu_ns(pid) for name, pid in daemons.items()}, time.perf_counter()
    time.sleep(idle_s)
    wall_s = time.perf_counter() - start
    return {name: (_idle_cpu_ns(pid) - before[name]) / 1e9 / wall_s * 100 for name, pid in daemons.items()}


def _idle_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of the live threads of a daemon and of its workers (a thread that ends meanwhile
    takes its time with it: fine for an idle window, not for a busy one)."""
    total = 0
    for process in (pid, *dataplane_workers(pid)):
        for task in glob.glob(f"/proc/{process}/task/*/schedstat"):
            try:
                with open(task) as stat:
                    total += int(stat.read().split()[0])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
    return total


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a daemon and of its data-plane workers (``dataplane_workers``), summed."""
    return _own_cpu_s(pid) + _workers_cpu_s(pid)


def _workers_cpu_s(pid: int) -> float:
    """The part of :func:`_cpu_s` spent in daemon ``pid``'s data-plane workers (0 without them). A worker
    that died during the measure takes its CPU with it: the split is a floor."""
    return sum(_own_cpu_s(p) for p in dataplane_workers(pid))


def _own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux); 0 for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
