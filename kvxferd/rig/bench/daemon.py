"""Through the daemons vs raw NIXL, in one run, on the same bytes; both engine transports side by side.

    kvxferd bench daemon [--quick] [--json] [--mtls] [--no-grpc-stream] [--no-same-host] [--no-push]

Two ``kvxferd serve`` processes (prefill rank, decode rank) over loopback;
the engines' caches are shared memory owned by this process. The raw
baseline is a NIXL agent in this process, registered on the decode cache,
reading the prefill daemon's agent: the same bytes over the same
cross-process transport, without the daemons' control plane.

For each engine path, ``socket`` (Reads batches over the daemon's reads
socket, a local engine's default) and ``stream`` (the same batches on the
gRPC Reads stream):

* bulk: one large request, alternating rounds of raw NIXL and the daemon
  path. Ratio = daemon GB/s / raw GB/s.
* per request at 300/s and at 1 000/s offered: small requests, each held
  first; submit -> delivered end to end at the engine, raw NIXL for the
  same request alone as the floor, CPU per request of each daemon.
* idle: each daemon's CPU with an engine registered and nothing to do.

The socket path runs twice: over NIXL (the top-level figures), and with
the decode daemon copying from the prefill engine's shared memory itself
(``same_host``, issue #37; both daemons on this host), each against the
same raw NIXL baseline.

The push path (issue #57, ``daemon_push.py``): the decode daemon expects, the
prefill daemon WRITEs once its engine holds; bulk and 300/s against raw NIXL
WRITE on the same descriptors (``push_bulk_ratio``, ``push_p50_overhead_us_300``).

``--mtls`` adds the socket path with the peer ports on mutual TLS (a
throw-away CA), plain and TLS alternating (plain, TLS, TLS, plain; means
of two): bytes move over NIXL, so TLS should cost the bulk nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from kvxferd.rig.bench.common import bench_main
from kvxferd.rig.bench.daemon_paths import Tls, bulk, overhead
from kvxferd.rig.bench.daemon_push import push_figures

# issue 12's targets on a 2-core machine: (key, comparison, value, label)
TARGETS = (("p50_overhead_us_300", "<=", 500.0, "end to end p50 over raw NIXL at 300 req/s (us)"),
           ("cpu_us_per_request_decode", "<=", 500.0, "CPU per request, decode daemon (us)"),
           ("cpu_us_per_request_prefill", "<=", 250.0, "CPU per request, prefill daemon (us)"),
           ("p99_ms_1000", "<=", 10.0, "end to end p99 at 1000 req/s offered (ms)"),
           ("achieved_rate_1000", ">=", 990.0, "achieved rate at 1000 req/s offered"),
           ("idle_cpu_percent", "<=", 0.5, "idle CPU per daemon (% of a core, the busier one)"),
           ("bulk_ratio", ">=", 0.97, "bulk ratio vs raw NIXL"))
SAME_HOST_KEYS = ("bulk_ratio", "p50_overhead_us_300")  # issue 37's targets for the same-host path: as over NIXL
PUSH_KEYS = ("push_bulk_ratio", "push_p50_overhead_us_300")  # issue 57's, flat; same host: same_host_push_*
HOSTS_KEYS = ("p50_overhead_us_300", "p99_ms_1000")  # issue 58's, flat again as hosts_* with --hosts
VERIFY_KEYS = ("bulk_ratio", "p50_overhead_us_300")  # issue 59's, flat as verify_*: every read checked
# issue 60's, flat as otel_* (OpenTelemetry on, every request traced) beside the same keys with it off
OTEL_KEYS = ("p50_overhead_us_300", "cpu_us_per_request_decode", "cpu_us_per_request_prefill")
FULL = dict(rounds=6, bulk_layers=32, bulk_blocks=256, num_requests_300=1500, num_requests_1000=3000, idle_s=5.0)
QUICK = dict(rounds=3, bulk_layers=16, bulk_blocks=128, num_requests_300=450, num_requests_1000=1500, idle_s=2.0)


def one_path(workdir: str, *, rounds: int, bulk_layers: int, bulk_blocks: int,
             num_requests_300: int, num_requests_1000: int, idle_s: float, rate_layers: int = 2,
             rate_blocks: int = 2, reads_socket: bool = True, same_host: bool = False, tls=None) -> dict:
    """Every figure of one engine path, with the flat keys the targets name; ``tls``: a :class:`Tls`, or a
    :class:`kvxferd.rig.hosts.BenchHosts` (the daemons on namespace hosts, mutual TLS)."""
    path = dict(reads_socket=reads_socket, same_host=same_host)
    b = bulk(workdir, bulk_layers, bulk_blocks, rounds, tls, **path)
    o300 = overhead(workdir, rate_layers, rate_blocks, 300.0, num_requests_300, tls, idle_s=idle_s, **path)
    o1000 = overhead(workdir, rate_layers, rate_blocks, 1000.0, num_requests_1000, tls, **path)
    cpu = o300["cpu_us_per_request"]
    return {"bulk": b, "overhead": o300, "overhead_1000": o1000,
            "bulk_ratio": b["ratio"],
            "p50_overhead_us_300": o300["end_to_end"]["p50_us"] - o300["raw_nixl"]["p50_us"],
            "cpu_us_per_request_decode": cpu["decode daemon"], "cpu_us_per_request_prefill": cpu["prefill daemon"],
            "workers_cpu_us_per_request_decode": o300["workers_cpu_us_per_request"]["decode daemon"],
            "workers_cpu_us_per_request_prefill": o300["workers_cpu_us_per_request"]["prefill daemon"],
            "p99_ms_1000": o1000["end_to_end"]["p99_us"] / 1e3, "achieved_rate_1000": o1000["achieved_rate_per_s"],
            "idle_cpu_percent": max(o300["idle_cpu_percent"].values())}


def verify_figures(workdir: str, sizes: dict) -> dict:
    """Issue #59: the bulk read and the reads at 300/s again, every hold digested and every read checked
    against its digests (socket path, over NIXL); the hold's time with its digests (``hold_ms``)."""
    b = bulk(workdir, sizes["bulk_layers"], sizes["bulk_blocks"], sizes["rounds"], verify=True)
    o300 = overhead(workdir, 2, 2, 300.0, sizes["num_requests_300"], verify=True)
    return {"bulk": b, "overhead": o300, "bulk_ratio": b["ratio"],
            "p50_overhead_us_300": o300["end_to_end"]["p50_us"] - o300["raw_nixl"]["p50_us"], "hold_ms": b["hold_ms"]}


def run(*, quick: bool = False, mtls: bool = False, sizes: dict | None = None,
        grpc_stream: bool = True, same_host: bool = True, hosts: bool = False, push: bool = True,
        verify: bool = True, otel: bool = False) -> dict:
    """The socket path's figures over NIXL at the top level; the same path with same-host copies under
    ``"same_host"`` (its two targets also flat: ``same_host_bulk_ratio``, ``same_host_p50_overhead_us_300``);
    the gRPC stream's under ``"stream"``, TLS under ``"mtls"``; the push keys with same-host copies under
    ``"same_host_push"`` (flat: ``same_host_push_bulk_ratio``, ``same_host_push_p50_overhead_us_300``).
    ``hosts``: only the socket path, its daemons on two namespace hosts (``"hosts": true``; two targets
    also as ``hosts_p50_overhead_us_300``, ``hosts_p99_ms_1000``). ``push``: the
    push path's keys too (issue #57: ``push_bulk_ratio``, ``push_p50_overhead_us_300``, over NIXL). ``verify``:
    the socket path again with every read checked against its hold's digests (issue #59:
    ``verify_bulk_ratio``, ``verify_p50_overhead_us_300``, under ``"verify"``). ``otel``: the reads at 300/s
    again with the daemons' OpenTelemetry spans on, every request traced, into a receiver in this process
    (issue #60: ``otel_p50_overhead_us_300``, ``otel_cpu_us_per_request_*``, under ``"otel"``)."""
    sizes = sizes or (QUICK if quick else FULL)
    if hosts:
        return _across_hosts(sizes, push)
    with tempfile.TemporaryDirectory(prefix="kvxb") as workdir:
        figures = one_path(workdir, **sizes)
        if push:
            figures.update(push_figures(workdir, sizes))
        if verify:  # the same path with digests: issue #59's keys, flat as verify_*
            figures["verify"] = verify_figures(workdir, sizes)
            for key in VERIFY_KEYS:
                figures["verify_" + key] = figures["verify"][key]
        if same_host:
            figures["same_host"] = one_path(workdir, same_host=True, **sizes)
            for key in SAME_HOST_KEYS:
                figures["same_host_" + key] = figures["same_host"][key]
            if push:  # the push keys again with copies instead of WRITEs, under "same_host_push"
                figures["same_host_push"] = push_figures(workdir, sizes, same_host=True)
                for key in PUSH_KEYS:
                    figures["same_host_" + key] = figures["same_host_push"][key]
        if otel:
            figures["otel"] = otel_figures(workdir, sizes)
            for key in OTEL_KEYS:
                figures["otel_" + key] = figures["otel"][key]
        if grpc_stream:
            figures["stream"] = one_path(workdir, reads_socket=False, **sizes)
        if mtls:
            figures["mtls"] = _mtls(workdir, sizes)
    return figures


def otel_figures(workdir: str, sizes: dict) -> dict:
    """Issue #60: the reads at 300/s, tracing off and on, alternating (off, on, on, off; means of two), every
    request traced when on; the spans the receiver got."""
    from kvxferd.rig.otlp import SpanReceiver

    runs = {False: [], True: []}
    with SpanReceiver() as receiver:
        for on in (False, True, True, False):
            o = overhead(workdir, 2, 2, 300.0, sizes["num_requests_300"], otel=receiver if on else None)
            cpu = o["cpu_us_per_request"]
            runs[on].append({"p50_overhead_us_300": o["end_to_end"]["p50_us"] - o["raw_nixl"]["p50_us"],
                             "cpu_us_per_request_decode": cpu["decode daemon"],
                             "cpu_us_per_request_prefill": cpu["prefill daemon"], "spans": o["spans_received"]})
    figures = {key: _mean(*(r[key] for r in runs[True])) for key in OTEL_KEYS}
    figures["off"] = {key: _mean(*(r[key] for r in runs[False])) for key in OTEL_KEYS}
    figures["spans_per_run"] = [r["spans"] for r in runs[True]]
    return figures


def _across_hosts(sizes: dict, push: bool) -> dict:
    """The socket path with the daemons on two network namespaces, raw NIXL across the same link."""
    from kvxferd.rig.hosts import BenchHosts

    with tempfile.TemporaryDirectory(prefix="kvxb") as workdir:
        placement = BenchHosts(workdir)
        try:
            figures = {**one_path(workdir, tls=placement, **sizes), "hosts": True}
            for key in HOSTS_KEYS:  # issue #58's names for the targets measured across hosts
                figures["hosts_" + key] = figures[key]
            if push:
                figures.update(push_figures(workdir, sizes, placement))
            return figures
        finally:
            placement.close()


def _mtls(workdir: str, sizes: dict) -> dict:
    """Plain vs mutual TLS on the socket path (plain, TLS, TLS, plain; means of two)."""
    tls = Tls(workdir)

    def one(t):
        return {"bulk": bulk(workdir, sizes["bulk_layers"], sizes["bulk_blocks"], sizes["rounds"], t),
                "overhead": overhead(workdir, 2, 2, 300.0, sizes["num_requests_300"], t)}

    plain_1, tls_1, tls_2, plain_2 = one(None), one(tls), one(tls), one(None)
    return {"plain": _mean(plain_1, plain_2), "tls": _mean(tls_1, tls_2)}


def _mean(a, b):
    """Numbers averaged leaf by leaf; anything else taken from ``a``."""
    if isinstance(a, dict):
        return {key: _mean(value, b[key]) for key, value in a.items()}
    if isinstance(a, (int, float)) and not isinstance(a, bool) and a != b:
        return (a + b) / 2
    return a


def format_table(f: dict) -> str:
    """Targets, both engine paths side by side, then each path's detail."""
    stream = f.get("stream", {})
    lines = [f"{'target (issue 12)':<52}{'goal':>10}{'socket':>10}{'stream':>10}"]
    for key, op, goal, label in TARGETS:
        value = f[key]
        lines.append(f"{label:<52}{op + ' ' + format(goal, 'g'):>10}{value:>10.3g}"
                     + f"{format(stream[key], '.3g') if key in stream else '-':>10}"
                     + f"  {_verdict(value, op, goal)}")
    for key, op, goal, label in (t for t in TARGETS if t[0] in SAME_HOST_KEYS and "same_host" in f):
        value = f["same_host_" + key]
        lines.append(f"{'same-host: ' + label:<52}{op + ' ' + format(goal, 'g'):>10}{value:>10.3g}{'':>10}"
                     f"  {_verdict(value, op, goal)}")
    where = (", daemons on two namespace hosts: mutual TLS, UCX over TCP on a veth link, the chart's NetworkPolicy;"
             " raw NIXL across the same link" if f.get("hosts") else "")
    text = "\n".join(lines) + f"\n\nsocket path (Reads batches on the reads socket{where}):\n" + _format_one(f)
    if "same_host" in f:
        text += "\n\nsocket path, same-host copies instead of NIXL (issue 37):\n" + _format_one(f["same_host"])
    if stream:
        text += "\n\nstream path (Reads batches on the gRPC stream):\n" + _format_one(stream)
    if "push_bulk" in f:
        text += "\n\n" + _format_push(f)
    if "same_host_push" in f:
        text += "\n\nsame host: " + _format_push(f["same_host_push"]).replace("WRITEs;", "copies;", 1)
    if "verify" in f:
        v = f["verify"]
        text += (f"\n\nevery read checked against its hold's digests (issue #59, socket path): verify_bulk_ratio "
                 f"{v['bulk_ratio']:.3f} (without: {f['bulk_ratio']:.3f}); verify_p50_overhead_us_300 "
                 f"{v['p50_overhead_us_300']:.0f} (without: {f['p50_overhead_us_300']:.0f}); the bulk hold with its "
                 f"digests {v['hold_ms']:.1f} ms (without: {f['bulk'].get('hold_ms', 0):.1f} ms); CPU per read "
                 + ", ".join(f"{name} {us:.0f} us" for name, us in v["overhead"]["cpu_us_per_request"].items()))
    if "otel" in f:
        o, off = f["otel"], f["otel"]["off"]
        text += (f"\n\nOpenTelemetry traces (issue #60, socket path, 300/s; off, on, on, off: means of two; every request "
                 f"traced when on): p50 over raw NIXL {off['p50_overhead_us_300']:.0f} us off, "
                 f"{o['p50_overhead_us_300']:.0f} us on; CPU per request decode daemon "
                 f"{off['cpu_us_per_request_decode']:.0f} -> {o['cpu_us_per_request_decode']:.0f} us, prefill daemon "
                 f"{off['cpu_us_per_request_prefill']:.0f} -> {o['cpu_us_per_request_prefill']:.0f} us; spans received "
                 f"per run {o['spans_per_run']}")
    if "mtls" in f:
        p, t = f["mtls"]["plain"], f["mtls"]["tls"]
        text += (f"\n\nmutual TLS on the peer ports (socket path; plain vs TLS): bulk ratio {p['bulk']['ratio']:.3f} vs "
                 f"{t['bulk']['ratio']:.3f}; end to end p50 {p['overhead']['end_to_end']['p50_us']:.0f} vs "
                 f"{t['overhead']['end_to_end']['p50_us']:.0f} us; handshake {p['bulk']['handshake_ms']:.2f} vs "
                 f"{t['bulk']['handshake_ms']:.2f} ms")
    return text


def _format_push(f: dict) -> str:
    """The push path (issue #57) against raw NIXL WRITE, next to the read's figures above."""
    b, o = f["push_bulk"], f["push_overhead"]
    return "\n".join([
        "push path (decode expects, prefill daemon WRITEs; timed from the prefill engine's Hold):",
        f"  bulk {b['bytes'] / 2**20:.0f} MiB: raw NIXL WRITE {b['raw_write_gbps']:.2f} GB/s ({b['raw_write_ms']:.1f} ms)"
        f"   push {b['push_gbps']:.2f} GB/s ({b['push_ms']:.1f} ms)   push_bulk_ratio {b['ratio']:.3f}"
        f"   ({b.get('copies', 0):g} of {b['rounds'] + 1} pushes copied same-host)",
        f"  {o['requests']} pushes of {o['bytes_per_request'] / 2**10:.0f} KiB at {o['rate_per_s']:.0f}/s (achieved "
        f"{o['achieved_rate_per_s']:.0f}/s), {o['failed']:g} failed: hold -> delivered p50 "
        f"{o['end_to_end']['p50_us']:.0f} us, p99 {o['end_to_end']['p99_us']:.0f} us; raw WRITE p50 "
        f"{o['raw_write']['p50_us']:.0f} us; push_p50_overhead_us_300 {f['push_p50_overhead_us_300']:.0f}",
        f"  one push at a time on idle daemons, hold -> delivered p50: expectation first "
        f"{f['push_alone']['expect_first']['p50_us']:.0f} us (push_alone_p50_us), hold first "
        f"{f['push_alone']['hold_first']['p50_us']:.0f} us"])


def _verdict(value: float, op: str, goal: float) -> str:
    return "met" if (value <= goal if op == "<=" else value >= goal) else "NOT met"


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
    for key, label in (("daemon_plan", "submit -> planned (daemon)"),
                       ("submit_to_posted", "submit -> posted (daemon)"),
                       ("daemon_transfer", "posted -> transfer ended (daemon)"),
                       ("daemon_check", "transfer ended -> checked (daemon)"),
                       ("completion_to_delivered", "completion -> delivered (engine)"),
                       ("end_to_end", "submit -> delivered (end to end)"), ("raw_nixl", "raw NIXL, same request alone")):
        lines.append(f"  {label:<34}{o[key]['p50_us']:>9.0f}{o[key]['p99_us']:>9.0f}")
    lines.append("  CPU per request: " + ", ".join(f"{name} {us:.0f} us" for name, us in o["cpu_us_per_request"].items()))
    if any(o.get("workers_cpu_us_per_request", {}).values()):
        lines.append("    of which data-plane workers: " + ", ".join(
            f"{name} {us:.0f} us" for name, us in o["workers_cpu_us_per_request"].items()))
    if "overhead_1000" in f:
        h = f["overhead_1000"]
        lines.append(f"  at {h['rate_per_s']:.0f}/s offered (achieved {h['achieved_rate_per_s']:.0f}/s): end to end p50 "
                     f"{h['end_to_end']['p50_us']:.0f} us, p99 {h['end_to_end']['p99_us']:.0f} us; CPU per request "
                     + ", ".join(f"{name} {us:.0f} us" for name, us in h["cpu_us_per_request"].items()))
    if o.get("idle_cpu_percent"):
        lines.append("  idle: " + ", ".join(f"{name} {pct:.2f} %" for name, pct in o["idle_cpu_percent"].items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer and smaller requests (under two minutes)")
    parser.add_argument("--mtls", action="store_true", help="also plain vs mutual TLS on the peer ports")
    parser.add_argument("--no-unary", action="store_true", help=argparse.SUPPRESS)  # the unary path is gone
    parser.add_argument("--no-grpc-stream", action="store_true", help="skip the gRPC Reads stream path")
    parser.add_argument("--no-same-host", action="store_true", help="skip the same-host copy path")
    parser.add_argument("--hosts", action="store_true", help="only the socket path, with the daemons on two "
                        "network namespaces (root): mutual TLS, the chart's NetworkPolicy, UCX over TCP; raw NIXL "
                        "across the same link")
    parser.add_argument("--no-push", action="store_true", help="skip the push path (issue #57)")
    parser.add_argument("--no-verify", action="store_true", help="skip the reads checked against digests (issue #59)")
    parser.add_argument("--otel", action="store_true", help="also the reads at 300/s with OpenTelemetry traces "
                        "off and on, every request traced (issue #60)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    from kvxferd.rig.verify.hosts.policy import HostsUnavailable

    try:
        figures = run(quick=args.quick, mtls=args.mtls, grpc_stream=not args.no_grpc_stream,
                      same_host=not args.no_same_host, hosts=args.hosts, push=not args.no_push,
                      verify=not args.no_verify, otel=args.otel)
    except HostsUnavailable as err:
        print(f"kvxferd bench daemon: {err}", file=sys.stderr)
        return 2
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.daemon", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
