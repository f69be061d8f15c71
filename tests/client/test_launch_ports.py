"""Daemons started by ``DaemonProcess`` listen below the ephemeral port range, so a restart in place gets
its ports back: every NIXL agent asks the kernel for two ephemeral ports (UCX's TCP transport listens on
them), and one of those once took a killed daemon's peer port before the daemon came back."""

import os
import socket

from kvxferd.client.launch import NUM_FIXED_PORTS, ephemeral_port_floor, free_ports
from kvxferd.xfer.agent import NixlAgent


def _listening_ports() -> set[int]:
    """Ports this process listens on (its own sockets only: other tests run beside it)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, ours
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    floor = ephemeral_port_floor()
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(floor - NUM_FIXED_PORTS <= p < floor for p in ports)
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_an_agent_listens_only_in_the_ephemeral_range():
    """What makes the choice above matter: NIXL's agents take ephemeral ports."""
    before = _listening_ports()
    agent = NixlAgent("ports-probe")
    try:
        taken = _listening_ports() - before
        assert taken and all(port >= ephemeral_port_floor() for port in taken), taken
    finally:
        agent.close()
