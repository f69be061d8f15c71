"""The ``kvxferd`` command line.

    kvxferd serve           the daemon (gRPC engine + peer services, notify bus, metrics)
    kvxferd health          is a daemon serving? (grpc.health.v1; exit 0 or 1, for container health checks)
    kvxferd dev-certs DIR   a throw-away CA and certificates for trying mutual TLS locally
    kvxferd demo            prefill -> decode reads over real NIXL, every byte verified
    kvxferd soak            random pairings and faults (kill -9, SIGSTOP, bad input) on real daemons; invariants
    kvxferd bench           every suite below, headline figures as a Markdown table
    kvxferd bench layout    span emission and planning benchmark (pure layers)
    kvxferd bench xfer      data plane vs raw NIXL, plan build, per-request planning
    kvxferd bench daemon    through the daemons vs raw NIXL: Reads stream vs unary, issue 12's targets
    kvxferd bench holds     hold bookkeeping from 10 to 100,000 outstanding holds
    kvxferd bench scale     cost per read from 1 to 16 remote ranks, and offered rate up to saturation
    kvxferd bench floors    what each step of a read costs alone (wake-up, thread hop, NIXL notice, gRPC)
    kvxferd bench gpu       GPU caches (CUDA IPC, NIXL VRAM): through the daemons vs raw NIXL; needs a GPU
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["serve"]:  # the daemon's fd table, grown while this process has one thread: no RCU wait
    from kvxferd.xfer.fdtable import reserve_fd_table  # (xfer/fdtable.py); imports nothing that starts one

    reserve_fd_table()

import argparse

from kvxferd import demo, serve, soak
from kvxferd.client import health
from kvxferd.verify import certs as devcerts
from kvxferd.service.base import config
from kvxferd.bench import daemon as daemon_bench
from kvxferd.bench import floors as floors_bench
from kvxferd.bench import gpu as gpu_bench
from kvxferd.bench import holds as holds_bench
from kvxferd.bench import layout as layout_bench
from kvxferd.bench import scale as scale_bench
from kvxferd.bench import suite
from kvxferd.bench import xfer as xfer_bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxferd", description="Disaggregated KV-cache transfer daemon.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the daemon next to one engine rank",
                                       description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve_parser)
    health.add_arguments(commands.add_parser("health", help="ask a daemon whether it serves (exit 0 or 1)"))
    devcerts.add_arguments(commands.add_parser("dev-certs", help="a throw-away CA and certificates for local mutual TLS"))
    demo_parser = commands.add_parser("demo", help="move and verify prefill->decode reads over NIXL for model presets",
                                      description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser)
    soak.add_arguments(commands.add_parser("soak", help="random pairings and faults on real daemons; every invariant checked",
                                           description=soak.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    bench = commands.add_parser("bench", help="run every benchmark suite (Markdown table), or one suite",
                                description=suite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_arguments(bench)
    suites = bench.add_subparsers(dest="suite")
    layout_bench.add_arguments(suites.add_parser("layout", help="span emission and planning (pure layers)"))
    xfer_bench.add_arguments(suites.add_parser("xfer", help="data plane vs raw NIXL, plan build, request planning"))
    daemon_bench.add_arguments(suites.add_parser("daemon", help="through the daemons vs raw NIXL; per-request overhead"))
    holds_bench.add_arguments(suites.add_parser("holds", help="hold bookkeeping from 10 to 100,000 holds"))
    floors_bench.add_arguments(suites.add_parser("floors", help="what each step of a read costs alone"))
    scale_bench.add_arguments(suites.add_parser("scale", help="1 to 16 remote ranks per read; offered rate to saturation"))
    gpu_bench.add_arguments(suites.add_parser("gpu", help="GPU caches: through the daemons vs raw NIXL (needs a GPU)",
                                              description=gpu_bench.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # keys and tokens may begin with "-" (config.attach_values)
        argv = ["serve", *config.attach_values(argv[1:])]
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "soak":
        return soak.run_args(args)  # not soak.run: importing kvxferd.soak.run would shadow that name
    if args.command == "serve":
        return serve.run(args)
    if args.command == "health":
        return health.run(args)
    if args.command == "dev-certs":
        return devcerts.run(args)
    if args.suite is None:
        return suite.run_args(args)
    suites = {"layout": layout_bench, "xfer": xfer_bench, "daemon": daemon_bench, "holds": holds_bench,
              "scale": scale_bench, "floors": floors_bench, "gpu": gpu_bench}
    return suites[args.suite].run_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
