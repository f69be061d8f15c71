"""The ``kvxferd`` command line.

    kvxferd serve           the daemon (gRPC engine + peer services, notify bus, metrics)
    kvxferd health          is a daemon serving? (grpc.health.v1; exit 0 or 1, for container health checks)
    kvxferd dev-certs DIR   a throw-away CA and certificates for trying mutual TLS locally
    kvxferd demo            prefill -> decode reads over real NIXL, every byte verified
    kvxferd soak            random pairings and faults (kill -9, SIGSTOP, bad input) on real daemons; invariants
    kvxferd bench           every suite below, headline figures as a Markdown table
    kvxferd bench layout    span emission and planning benchmark (pure layers)
    kvxferd bench xfer      data plane vs raw NIXL, plan build, per-request planning
    kvxferd bench push      push (WRITE) vs pull (READ) on the data plane, each against raw NIXL
    kvxferd bench layers    a push layer by layer vs one batch after the forward pass, through daemons
    kvxferd bench daemon    through the daemons vs raw NIXL: Reads stream vs unary, issue 12's targets
    kvxferd bench holds     hold bookkeeping from 10 to 100,000 outstanding holds
    kvxferd bench scale     cost per read from 1 to 16 remote ranks, and offered rate up to saturation
    kvxferd bench floors    what each step of a read costs alone (wake-up, thread hop, NIXL notice, gRPC)
    kvxferd bench processes what a control plane and data-plane workers cost apart (a question, an fd, a start)
    kvxferd bench gpu       GPU caches (CUDA IPC, NIXL VRAM): through the daemons vs raw NIXL; needs a GPU
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["serve"]:  # the daemon's fd table, grown while this process has one thread: no RCU wait
    from kvxferd.xfer.osutil.fdtable import reserve_fd_table  # (xfer/osutil/fdtable.py); imports nothing that starts one

    reserve_fd_table()

import argparse

import importlib

from kvxferd import serve
from kvxferd.client import health
from kvxferd.service.base import config

# The rig (kvxferd/rig/) is imported only for the command that runs: `kvxferd serve` never loads it.
RIG_COMMANDS = {  # command -> (module, help)
    "dev-certs": ("kvxferd.rig.verify.certs", "a throw-away CA and certificates for local mutual TLS"),
    "demo": ("kvxferd.rig.demo", "move and verify prefill->decode reads over NIXL for model presets"),
    "soak": ("kvxferd.rig.soak", "random pairings and faults on real daemons; every invariant checked"),
    "bench": ("kvxferd.rig.bench.suite", "run every benchmark suite (Markdown table), or one suite"),
}
BENCH_SUITES = {  # suite -> (module, help)
    "layout": ("kvxferd.rig.bench.layout", "span emission and planning (pure layers)"),
    "xfer": ("kvxferd.rig.bench.xfer", "data plane vs raw NIXL, plan build, request planning"),
    "push": ("kvxferd.rig.bench.push", "push (WRITE) vs pull (READ) on the data plane, each vs raw NIXL"),
    "layers": ("kvxferd.rig.bench.layers", "a push layer by layer vs one batch after the forward pass"),
    "daemon": ("kvxferd.rig.bench.daemon", "through the daemons vs raw NIXL; per-request overhead"),
    "holds": ("kvxferd.rig.bench.holds", "hold bookkeeping from 10 to 100,000 holds"),
    "floors": ("kvxferd.rig.bench.floors", "what each step of a read costs alone"),
    "processes": ("kvxferd.rig.bench.processes", "what a control plane and data-plane workers cost apart"),
    "scale": ("kvxferd.rig.bench.scale", "1 to 16 remote ranks per read; offered rate to saturation"),
    "gpu": ("kvxferd.rig.bench.gpu", "GPU caches: through the daemons vs raw NIXL (needs a GPU)"),
}
_DOCUMENTED = {"demo", "soak", "bench", "gpu"}  # whose --help shows the module's docstring


def _rig_parser(commands, name: str, table: dict, load: bool):
    module_name, help_text = table[name]
    parser = commands.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
    if load:
        module = importlib.import_module(module_name)
        if name in _DOCUMENTED:
            parser.description = module.__doc__
        module.add_arguments(parser)
    return parser


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; a rig command's arguments are added only when ``argv`` names that command."""
    chosen = (argv or [None])[0]
    parser = argparse.ArgumentParser(prog="kvxferd", description="Disaggregated KV-cache transfer daemon.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the daemon next to one engine rank",
                                       description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve_parser)
    health.add_arguments(commands.add_parser("health", help="ask a daemon whether it serves (exit 0 or 1)"))
    for name in RIG_COMMANDS:
        rig = _rig_parser(commands, name, RIG_COMMANDS, load=name == chosen)
        if name == "bench" and chosen == "bench":
            suites = rig.add_subparsers(dest="suite")
            for suite_name in BENCH_SUITES:
                _rig_parser(suites, suite_name, BENCH_SUITES, load=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # keys and tokens may begin with "-" (config.attach_values)
        argv = ["serve", *config.attach_values(argv[1:])]
    args = build_parser(argv).parse_args(argv)
    if args.command == "serve":
        return serve.run(args)
    if args.command == "health":
        return health.run(args)
    if args.command == "soak":
        return importlib.import_module("kvxferd.rig.soak").run_args(args)  # not .run: a module of that name
    if args.command == "bench" and args.suite is not None:
        return importlib.import_module(BENCH_SUITES[args.suite][0]).run_args(args)
    module = importlib.import_module(RIG_COMMANDS[args.command][0])
    return module.run_args(args) if args.command == "bench" else module.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
