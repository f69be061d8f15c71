"""Many hosts on one machine: network namespaces on one bridge, made for one run and removed after it.

Each "host" is a network namespace with one interface, ``eth0``, the end of
a veth pair whose other end is a port of a bridge. The bridge lives in a
namespace of its own (the switch), so the machine's own namespace gets no
interface, no address and no route: all traffic stays inside namespaces the
run created. Addresses come from the benchmarking range 198.18.0.0/15
(RFC 2544), which is never routed anywhere::

    kvx-<run>-h0            kvx-<run>-sw             kvx-<run>-h1
    eth0 198.18.0.1 ──veth── h0 ┐                ┌ h1 ──veth── eth0 198.18.0.2
                                └──── br0 (bridge) ┘
    lo (notify bus, metrics)                          lo

A link fault happens at the switch port (a pulled cable: the host's
``eth0`` loses carrier). :meth:`Fabric.close` kills whatever still runs in
the namespaces and deletes them; namespaces left by a run that died are
removed by the next one (their names carry the creator's pid).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time

from kvxferd.rig.verify.hosts.nsenter import NETNS_DIR

SUBNET = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15, the benchmarking range
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
NAME_PREFIX = "kvx-"
_OURS = re.compile(r"^kvx-(\d+)-[0-9a-f]{4}-(sw|h\d+)$")
MAX_HOSTS = 32
IPTABLES = "iptables-legacy"  # NFQUEUE (linkdelay.py) needs the legacy backend: nft's queue is not everywhere


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the fabric: its namespace, its address, and its port on the switch."""

    name: str  # h0, h1, ...
    netns: str
    address: str
    port: str  # the bridge port (in the switch namespace) its eth0 is wired to
    interface: str = "eth0"


def _run(*command: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why namespace hosts cannot run here (None when they can): root, ``ip``, ``iptables-legacy``, netns."""
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "this system has no network namespaces (Linux only)"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    for tool, package in (("ip", "iproute2"), (IPTABLES, "iptables")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package}; scripts/system-deps.sh installs it)"
    probe = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(2)}-h0"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        filtered = _run("ip", "netns", "exec", probe, IPTABLES, "-w", "-L", "INPUT", check=False)
        if filtered.returncode != 0:
            return f"{IPTABLES} does not work in a namespace: {filtered.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete the namespaces of fabrics whose creating process is gone; their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(NETNS_DIR)):
            match = _OURS.match(name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                _delete_namespace(name)
                removed.append(name)
    return removed


def _delete_namespace(name: str) -> None:
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    for _ in range(50):  # a killed process leaves its namespace a moment later
        if not _run("ip", "netns", "pids", name, check=False).stdout.split():
            break
        time.sleep(0.02)
    _run("ip", "netns", "del", name, check=False)


class Fabric:
    """``num_hosts`` namespaces on one bridge; use as a context manager (teardown also on failure)."""

    def __init__(self, num_hosts: int) -> None:
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in 1..{MAX_HOSTS}, got {num_hosts}")
        remove_stale()
        self.run_id = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{NAME_PREFIX}{self.run_id}-sw"
        addresses = list(SUBNET.hosts())
        self.hosts = [Host(f"h{i}", f"{NAME_PREFIX}{self.run_id}-h{i}", str(addresses[i]), f"h{i}")
                      for i in range(num_hosts)]
        self._namespaces: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_namespace(host.netns)
            _run("ip", "-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", host.interface,
                 "netns", host.netns)
            _run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", host.interface)
            _run("ip", "-n", host.netns, "link", "set", host.interface, "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @staticmethod
    def command(host: Host, *argv: str) -> list[str]:
        """``argv`` as run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def run(self, host: Host, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` and wait for it."""
        return _run(*self.command(host, *argv), check=check)

    def set_link(self, host: Host, up: bool) -> None:
        """Plug or pull ``host``'s cable (its switch port up or down)."""
        _run("ip", "-n", self.switch, "link", "set", host.port, "up" if up else "down")

    def link_bytes(self, host: Host) -> dict[str, int]:
        """Bytes ``host``'s eth0 received and sent so far (its counters in the kernel)."""
        shown = json.loads(_run("ip", "-n", host.netns, "-s", "-j", "link", "show", host.interface).stdout)
        stats = shown[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them (idempotent)."""
        while self._namespaces:
            _delete_namespace(self._namespaces.pop())
