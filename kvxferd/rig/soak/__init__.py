"""``kvxferd soak``: a randomized run on real daemons and real NIXL while faults strike at random.

Pairings are drawn at random (model kind, TP sizes 1..4 on each side,
KV heads, block and kernel block sizes, decode prefix hits); a prefill
and a decode engine process run a stream of requests through one
``kvxferd serve`` per rank; ``faults.py`` lists what strikes them. Every
read is checked byte for byte, every hold must end exactly once, and the
daemons that were not killed must neither die nor leak. Exit 1 when any
invariant broke (they are listed with counts, and examples, in ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import json
import sys
import traceback
import tempfile

from kvxferd.rig.soak.faults import DIGEST_KINDS, KINDS, LOOPBACK_ONLY, NET_KINDS, TLS_KINDS, WORKER_KINDS, default_kinds
from kvxferd.rig.soak.report import INVARIANTS, Report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of requests (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pairings, requests and faults "
                                                             "(a failing run replays with the same seed)")
    parser.add_argument("--fault-rate", type=float, default=0.25,
                        help="share of requests that get a fault (default 0.25; 0: none)")
    parser.add_argument("--faults", metavar="KIND[,KIND...]",
                        help="the fault kinds to draw from (default: all this run can inject; one kind replays a "
                             f"finding); network kinds ({', '.join(NET_KINDS)}) need --hosts")
    parser.add_argument("--hosts", type=int, default=0, metavar="N",
                        help="run on N network namespaces as hosts (root only; 2..8): prefill on h0, decode hosts "
                             "h1.. taking turns, mutual TLS, the chart's NetworkPolicy, and real network faults "
                             "(default: every daemon on loopback)")
    parser.add_argument("--dataplane-workers", action="store_true",
                        help="daemons serve peers through data-plane worker processes (kvxferd serve "
                             "--dataplane-workers), and the kill_worker fault joins the others")
    parser.add_argument("--dataplane-reader-workers", action="store_true",
                        help="with --dataplane-workers: each rank's own READs from a reader worker too "
                             "(kvxferd serve --dataplane-reader-workers); kill_worker picks either kind")
    parser.add_argument("--push-share", type=float, default=0.25,
                        help="share of requests sent as pushes (issue #57: the prefill daemons write; default 0.25; "
                             "none with --dataplane-workers, where push is not built)")
    parser.add_argument("--verify-share", type=float, default=0.25,
                        help="share of the other reads checked against their holds' digests too (issue #59; "
                             "default 0.25): none may fail corrupt")
    parser.add_argument("--epoch-requests", type=int, default=40,
                        help="requests per pairing before the next is drawn (default 40)")
    parser.add_argument("--max-tp", type=int, default=4, choices=range(1, 5), metavar="{1..4}",
                        help="largest TP size on each side; one daemon per rank is started for both (default 4)")
    parser.add_argument("--logs", metavar="DIR", help="keep the daemons' logs and sockets in DIR (default: a "
                                                      "temporary directory, removed at the end)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _table(summary: dict) -> str:
    lines = [f"kvxferd soak: seed {summary['seed']}, {summary['duration_s']:g} s, {summary['pairings']} pairings, "
             f"{summary['requests']} requests ({summary['pushes']} pushes, {summary['layered_pushes']} of them layer "
             "by layer), "
             f"{summary['verified_bytes'] / 2**20:,.1f} MiB verified",
             f"read outcomes per rank: {summary['read_outcomes']} (of them pushes: {summary['push_outcomes']})",
             f"digests: {summary['digests']}",
             f"faults: {summary['faults']}", f"holds: {summary['holds']}", "invariants:"]
    lines += [f"  {'ok  ' if not count else 'FAIL'} {name}: {count} violations ({INVARIANTS[name]})"
              for name, count in summary["invariants"].items()]
    for violation in summary["violations"]:
        lines += [f"    {violation['invariant']}: {example}" for example in violation["examples"]]
    lines += [f"figure {name}: n={f['n']} p50 {f['p50_s']:g} s, max {f['max_s']:g} s"
              for name, f in summary["figures"].items()]
    return "\n".join(lines)


def run_args(args: argparse.Namespace) -> int:
    """Exit 0 when every invariant held, 1 when any broke, 2 on bad arguments."""
    from kvxferd.rig.verify.hosts.policy import MAX_HOSTS, HostsUnavailable
    from kvxferd.rig.soak.run import Soak

    if args.duration <= 0 or not 0 <= args.fault_rate <= 1 or not 0 <= args.push_share <= 1 or args.epoch_requests < 1 \
            or not 0 <= args.verify_share <= 1:
        print("kvxferd soak: --duration must be > 0, --fault-rate, --push-share and --verify-share in [0, 1], "
              "--epoch-requests >= 1",
              file=sys.stderr)
        return 2
    if args.hosts and not 2 <= args.hosts <= MAX_HOSTS:
        print(f"kvxferd soak: --hosts must be 2..{MAX_HOSTS} (a prefill host and at least one decode host)",
              file=sys.stderr)
        return 2
    reader_workers = args.dataplane_workers and args.dataplane_reader_workers
    args.faults = args.faults or ",".join(default_kinds(bool(args.hosts), args.dataplane_workers, reader_workers))
    kinds = set(args.faults.split(","))
    unknown = sorted(kinds - set(KINDS) - set(NET_KINDS) - set(WORKER_KINDS))
    if unknown:
        print(f"kvxferd soak: unknown fault kinds {unknown}; known: {', '.join(KINDS + NET_KINDS + WORKER_KINDS)}",
              file=sys.stderr)
        return 2
    if kinds & set(WORKER_KINDS) and not args.dataplane_workers:
        print(f"kvxferd soak: {', '.join(sorted(kinds & set(WORKER_KINDS)))} needs --dataplane-workers (without "
              "them there is no worker to kill or replace)", file=sys.stderr)
        return 2
    if kinds & set(DIGEST_KINDS) and reader_workers:
        print(f"kvxferd soak: {', '.join(sorted(kinds & set(DIGEST_KINDS)))} cannot run with "
              "--dataplane-reader-workers (a reader worker checks no digests yet)", file=sys.stderr)
        return 2
    misplaced = sorted(kinds & set(NET_KINDS + TLS_KINDS if not args.hosts else LOOPBACK_ONLY))
    if misplaced:
        print(f"kvxferd soak: {', '.join(misplaced)} " + ("need --hosts (network faults act on real links; the hosts' daemons use TLS)"
              if not args.hosts else "run only on loopback (the driver does not sit on the hosts' links)"),
              file=sys.stderr)
        return 2
    report = Report(args.seed, args.duration)  # progress on stderr; --json goes to stdout
    with contextlib.ExitStack() as stack:
        workdir = args.logs or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvxferd-soak-"))
        os.makedirs(workdir, exist_ok=True)
        try:
            soak = Soak(args, workdir, report)
        except HostsUnavailable as err:
            print(f"kvxferd soak: {err}", file=sys.stderr)
            return 2
        try:
            soak.run()
        except Exception as err:  # the run could not go on: that is a finding too
            traceback.print_exc(file=sys.stderr)  # where it stopped, for whoever replays the seed
            report.violate("recovery", f"the run stopped: {type(err).__name__}: {err}")
        finally:
            soak.close()
    summary = report.summary()
    print(json.dumps(summary) if args.json else "\n" + _table(summary))
    return 1 if summary["violations"] else 0
