"""Run the kvxferd daemon.

Every option can also come from a ``KVXFERD_<OPTION>`` environment variable
or a TOML/YAML ``--config`` file (flags win over the environment, which wins
over the file). With no options the daemon listens on loopback defaults and
prints one line with every address when it is ready.

Exit codes: 0 clean shutdown (SIGTERM/SIGINT), 2 bad configuration,
3 start-up failure.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import sys

from kvxferd.errors import KvxferError
from kvxferd.service.base.config import config_from_args
from kvxferd.service.daemon import EXIT_CONFIG, serve
from kvxferd.service.base.logs import setup_logging
from kvxferd.service.base import audit
from kvxferd.service.net import corelog


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except KvxferError as err:
        print(f"kvxferd serve: bad configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_level, config.log_format)
    faulthandler.enable()  # a crash in native code (UCX, NIXL) leaves the Python stack it came from in the log
    audit.configure(config.audit_window_s, config.audit_lines_per_window)
    if config.tls or config.engine_tcp:  # TLS handshakes refused in gRPC's core: audit lines (corelog.py)
        corelog.route_core_log(config.log_level, config.log_format, config.audit_window_s,
                               config.audit_lines_per_window)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency; plain asyncio works too
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
