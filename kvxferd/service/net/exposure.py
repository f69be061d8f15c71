"""What the daemon exposes to the network, decided before anything listens.

* A listener reachable from another host must authenticate: the peer port
  with mutual TLS, the notify bus with CURVE, engine TCP with TLS and a
  token. Otherwise the daemon refuses to start, unless ``insecure`` is set
  (development), and then says so at start and in a metric.
* NIXL's UCX data plane listens on every interface by default; it is bound
  to the interface of the advertised peer address instead, so configuring
  loopback means loopback. Its TCP transport listens on ports the OS picks,
  unless ``ucx_tcp_port_range`` pins them (so a NetworkPolicy can admit them).
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base.config import WILDCARD_HOSTS, DaemonConfig


def is_loopback(host: str) -> bool:
    """True for a loopback literal or ``localhost``; a wildcard or any other name is not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_listeners(config: DaemonConfig) -> list[str]:
    """Listeners that another host could reach without authenticating (``name=host``)."""
    found = []
    if not config.tls and not is_loopback(config.peer_host):
        found.append(f"peer={config.peer_host}")
    if not config.notify_curve_secret_key and not is_loopback(config.notify_host):
        found.append(f"notify={config.notify_host}")
    return found


def refusal(config: DaemonConfig) -> str | None:
    """The one-line reason not to start, or None."""
    exposed = insecure_listeners(config)
    if not exposed or config.insecure:
        return None
    return (f"{', '.join(exposed)} would be reachable from other hosts without authentication: set tls_cert/tls_key/"
            "tls_ca/peer_allowed_ids (peer) and notify_curve_secret_key (bus), bind them to 127.0.0.1, or pass "
            "--insecure for development")


def ucx_net_devices(config: DaemonConfig) -> str:
    """``UCX_NET_DEVICES`` for this daemon: the configured value, or the advertised address's interface."""
    if config.ucx_net_devices:
        return config.ucx_net_devices
    host = (config.advertise_host or config.peer_host).strip("[]")
    if host in WILDCARD_HOSTS:
        raise InvalidArgumentError("ucx_net_devices", "cannot tell the data-plane interface of a wildcard address; "
                                                      "set advertise_host or ucx_net_devices")
    try:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0].split("%")[0])
    except (OSError, ValueError, IndexError):
        raise InvalidArgumentError("ucx_net_devices", f"cannot resolve {host!r}; set ucx_net_devices") from None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(entry.address.split("%")[0]) == address:
                        return name
                except ValueError:
                    continue
    raise InvalidArgumentError("ucx_net_devices", f"no interface of this host has {address}; set ucx_net_devices")


# UCX's tcp transport answers a peer's READ of our memory in messages of this size (its default 8 KiB).
# Between two namespace hosts a 256 KiB READ then cost the holder 200 µs of CPU instead of 440 µs, and
# its reader 0.4-0.45 ms instead of 0.6-0.8 ms at p50 (issue #58, docs/benchmarks.md). 64 KiB is UCX's
# default receive segment, so peers on UCX's defaults (vLLM's own NIXL agents) still take every message.
UCX_TCP_TX_SEG_SIZE = "64k"


def ucx_environment(config: DaemonConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The UCX variables to set before the first NIXL agent: ``UCX_NET_DEVICES`` always,
    ``UCX_TCP_PORT_RANGE`` (the tcp transport's listening ports) when ``ucx_tcp_port_range`` is set, and
    ``UCX_TCP_TX_SEG_SIZE`` unless the operator's ``environ`` (default: this process's) sets it."""
    environ = os.environ if environ is None else environ
    environment = {"UCX_NET_DEVICES": ucx_net_devices(config)}
    if "UCX_TCP_TX_SEG_SIZE" not in environ:
        environment["UCX_TCP_TX_SEG_SIZE"] = UCX_TCP_TX_SEG_SIZE
    if config.ucx_tcp_port_range is not None:
        environment["UCX_TCP_PORT_RANGE"] = config.ucx_tcp_port_range
    return environment
