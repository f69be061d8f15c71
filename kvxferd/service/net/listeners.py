"""The daemon's listeners at start-up: binding gRPC ports, claiming the engine socket, the engine token.

Each failure is a :class:`StartupError` with a one-line reason; ``kvxferd
serve`` prints it and exits 3.
"""

from __future__ import annotations

import os
import socket

import grpc

from kvxferd.service.peers.tls import TlsFiles


class StartupError(Exception):
    """The daemon could not start (exit code 3)."""


def bracket_host(host: str) -> str:
    """``host`` as it goes before ``:port`` (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def read_token(path: str) -> str:
    """The engine bearer token from ``engine_token_file`` (at least 16 characters)."""
    try:
        token = open(path, encoding="utf-8").read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise StartupError(f"engine_token_file: {err}") from None
    if len(token) < 16:
        raise StartupError("engine_token_file: the token must have at least 16 characters")
    return token


def engine_tls(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS for engine_tcp: the daemon's certificate; engines authenticate with the bearer token."""
    material = tls.current()
    return grpc.ssl_server_credentials([(material.key, material.cert)])


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a listening port (TLS when ``credentials``); the bound port, or :class:`StartupError`."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as err:
        raise StartupError(f"cannot listen on {address}: {err}") from None
    if port == 0 and not address.startswith("unix:"):
        raise StartupError(f"cannot listen on {address} (in use?)")
    return port


def claim_unix_socket(path: str) -> None:
    """Remove a dead daemon's socket file; refuse to steal a live one."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left over from a crash
        return
    finally:
        probe.close()
    raise StartupError(f"another process already serves the engine socket {path}")
