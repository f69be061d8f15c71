"""``kvxferd health``: ask a daemon's grpc.health.v1 service whether it serves (container health checks)."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxferd.wire import serving
from kvxferd.wire.names import default_engine_socket, env_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="unix:<engine socket> or host:port of a plaintext listener (default: the socket "
                             f"{env_name('engine_socket')} names; else every daemon serving in this container, "
                             "whatever --engine-socket it was given (the records in the runtime directory, "
                             f"{env_name('runtime_dir')}); else the default engine socket); the peer port speaks "
                             "mutual TLS when TLS is on, so ask the engine socket")
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


def default_target() -> str:
    """The engine socket a daemon started with the same environment listens on, as a gRPC target."""
    socket_path = os.environ.get(env_name("engine_socket")) or default_engine_socket(
        os.environ.get(env_name("daemon_id"), "kvxferd"), os.environ.get(env_name("runtime_dir")))
    return f"unix:{socket_path}"


def default_targets() -> list[str]:
    """What ``kvxferd health`` asks without ``--target``.

    The socket the environment names, when it names one (explicit); else the
    engine socket of every daemon serving in this container, read from the
    records the daemons leave (:mod:`kvxferd.wire.serving`): a container's
    HEALTHCHECK has the image's environment but never the daemon's flags;
    else the default engine socket (no daemon serving: unreachable).
    """
    if os.environ.get(env_name("engine_socket")):
        return [default_target()]
    sockets = serving.live_engine_sockets(serving.record_dir())
    return [f"unix:{path}" for path in sockets] or [default_target()]


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every target serves, 1 otherwise; prints each status."""
    healthy = True
    for target in [args.target] if args.target else default_targets():
        status = check(target, args.service, args.timeout_s)
        healthy = healthy and status == "SERVING"
        print(f"{target} {args.service or '(daemon)'}: {status}",
              file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if healthy else 1
