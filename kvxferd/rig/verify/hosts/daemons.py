"""Daemons on the fabric's hosts, configured as the chart runs them across real hosts.

Rank ``i`` of a role on a host listens as container ``kvxferd-<i>`` of the
chart's pod does: the peer port ``ports.peer + i`` on the host's address with
mutual TLS (a throw-away CA; every daemon's certificate carries the release's
SPIFFE id, which the allow-list names), the notify bus ``ports.notify + i``
and metrics ``ports.metrics + i`` on the host's loopback, UCX's tcp
transport on the host's ``eth0`` within ``ports.ucx``. Each host has its own
host secret, so no daemon takes another host's daemon for a neighbour.

UCX's shared-memory transports are switched off (``UCX_TLS=tcp``): these
hosts share one kernel, and UCX would otherwise carry their bytes through
shared memory instead of the link (the tests count the link's bytes).
"""

from __future__ import annotations

import dataclasses
import os

from kvxferd.client import DaemonProcess
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.verify.hosts.fabric import Host
from kvxferd.rig.verify.hosts.nsenter import call_in_netns
from kvxferd.rig.verify.hosts.policy import chart_values, release_config

UCX_TRANSPORTS = "tcp"


@dataclasses.dataclass(frozen=True)
class ChartPorts:
    """The chart's port bases and UCX range (values.yaml ``ports``)."""

    peer: int
    notify: int
    metrics: int
    ucx_low: int
    ucx_high: int

    @classmethod
    def from_chart(cls) -> "ChartPorts":
        ports = chart_values()["ports"]
        return cls(int(ports["peer"]), int(ports["notify"]), int(ports["metrics"]), int(ports["ucx"]["min"]),
                   int(ports["ucx"]["max"]))

    @property
    def ucx_range(self) -> str:
        return f"{self.ucx_low}-{self.ucx_high}"


class Pki:
    """A throw-away CA and one certificate per name, with the release's identity and server name (as rendered)."""

    def __init__(self, directory: str) -> None:
        self.ca = DevCA(directory, name="kvxferd fabric CA")
        config = release_config()
        (self.identity,) = config["peer_allowed_ids"]
        self.server_name = config["peer_server_name"]

    def client_files(self, name: str) -> tuple[str, str, str]:
        """``(ca, cert, key)`` paths of a new certificate with the release's identity (a raw NIXL baseline's)."""
        issued = self.ca.issue(name, dns_names=(self.server_name,), spiffe_id=self.identity)
        return str(self.ca.cert_path), str(issued.cert), str(issued.key)

    def tls_args(self, name: str, *, spiffe_id: str | None = None) -> tuple[str, ...]:
        """The daemon flags for mutual TLS with a certificate issued to ``name`` (another identity: ``spiffe_id``)."""
        issued = self.ca.issue(name, dns_names=(self.server_name,), spiffe_id=spiffe_id or self.identity)
        return ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(self.ca.cert_path),
                "--peer-allowed-ids", self.identity, "--peer-server-name", self.server_name)


class NamespaceDaemon(DaemonProcess):
    """A ``kvxferd serve`` inside a host's namespace; its metrics are read from inside it too."""

    def __init__(self, daemon_id: str, host: Host, **kwargs) -> None:
        self.host = host
        super().__init__(daemon_id, prefix=("ip", "netns", "exec", host.netns), **kwargs)

    def metrics_text(self) -> str:
        return call_in_netns(self.host.netns, super().metrics_text)

    def start_again(self) -> "NamespaceDaemon":
        """A new daemon with this one's flags, addresses and host (a restart in place)."""
        return NamespaceDaemon(self.daemon_id, self.host, socket_dir=os.path.dirname(self.log_path), env=self._env,
                               extra_args=self._extra_args, ready_timeout_s=60)


def ucx_environment(host: Host, ports: ChartPorts) -> dict[str, str]:
    """UCX settings for anything on ``host`` that makes a NIXL agent (daemons, raw baselines)."""
    return {"UCX_TLS": UCX_TRANSPORTS, "UCX_NET_DEVICES": host.interface, "UCX_TCP_PORT_RANGE": ports.ucx_range}


def daemon_args(host: Host, rank: int, ports: ChartPorts, pki: Pki, host_dir: str) -> tuple[str, ...]:
    """Every flag of rank ``rank``'s daemon on ``host`` (as the chart's container ``kvxferd-<rank>``)."""
    return ("--peer-host", host.address, "--peer-port", str(ports.peer + rank),
            "--notify-port", str(ports.notify + rank), "--metrics-port", str(ports.metrics + rank),
            "--ucx-tcp-port-range", ports.ucx_range, "--peer-secret-file", os.path.join(host_dir, "peer.secret"),
            *pki.tls_args(f"{host.name}-{rank}"))


def host_dir(workdir: str, host: Host) -> str:
    """``host``'s private directory under ``workdir`` (its host secret; sockets and logs where wanted)."""
    path = os.path.join(workdir, host.name)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def host_daemon(daemon_id: str, host: Host, rank: int, *, workdir: str, pki: Pki, ports: ChartPorts,
                socket_dir: str | None = None, extra_args: tuple[str, ...] = ()) -> NamespaceDaemon:
    """Start (not wait for) rank ``rank``'s daemon on ``host``, as the chart's container ``kvxferd-<rank>``;
    its socket and log in ``socket_dir`` (default: the host's directory)."""
    private = host_dir(workdir, host)
    return NamespaceDaemon(daemon_id, host, socket_dir=socket_dir or private, wait=False,
                           env=ucx_environment(host, ports),
                           extra_args=(*daemon_args(host, rank, ports, pki, private), *extra_args))


def start_host_daemons(host: Host, role: str, count: int, *, workdir: str, pki: Pki, ports: ChartPorts,
                       extra_args: tuple[str, ...] = ()) -> list[NamespaceDaemon]:
    """``count`` daemons of ``role`` on ``host`` (ranks 0..count-1), started at once, each waited for."""
    return NamespaceDaemon.wait_all([host_daemon(f"{host.name}-{role}{rank}", host, rank, workdir=workdir, pki=pki,
                                                 ports=ports, extra_args=extra_args) for rank in range(count)])
