"""``kvxferd health``: ask a daemon's grpc.health.v1 service whether it serves (container health checks)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:47100",
                        help="the daemon's peer address host:port, or unix:<engine socket> (default 127.0.0.1:47100)")
    parser.add_argument("--service", default="", help="a service name (e.g. kvxfer.v1.PeerService); default: the daemon")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="give up after this long (default 3)")


def check(target: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The serving status name (``SERVING``, ``NOT_SERVING``, ...) or ``UNREACHABLE: ...``."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as err:
            return f"UNREACHABLE: {err.code().name}: {err.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when serving, 1 otherwise; prints the status."""
    status = check(args.target, args.service, args.timeout_s)
    print(f"{args.target} {args.service or '(daemon)'}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1
