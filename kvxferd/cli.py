"""The ``kvxferd`` command line.

    kvxferd demo            plan and verify prefill -> decode reads (layout/TP demo)
    kvxferd bench layout    span emission and planning benchmark
"""

from __future__ import annotations

import argparse

from kvxferd import demo
from kvxferd.bench import layout as layout_bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxferd", description="Disaggregated KV-cache transfer daemon.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="plan and verify prefill->decode reads for model presets",
                                      description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser)
    bench = commands.add_parser("bench", help="run a benchmark suite")
    suites = bench.add_subparsers(dest="suite", required=True)
    layout_bench.add_arguments(suites.add_parser("layout", help="span emission and planning (pure layers)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    return layout_bench.run_args(args)  # "bench layout", the only suite so far


if __name__ == "__main__":
    raise SystemExit(main())
