"""Daemons started by ``DaemonProcess`` listen below the ephemeral port range, so a restart in place gets
its ports back: every NIXL agent asks the kernel for two ephemeral ports (UCX's TCP transport listens on
them), and one of those once took a killed daemon's peer port before the daemon came back."""

import os

from kvxferd.client.launch import NUM_FIXED_PORTS, ephemeral_port_floor, free_ports, port_is_free
from kvxferd.xfer.agent import NixlAgent
from tests.sockets import listening_sockets


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    floor = ephemeral_port_floor()
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(floor - NUM_FIXED_PORTS <= p < floor for p in ports)
    assert all(port_is_free(port) for port in ports)


def test_an_agent_listens_only_in_the_ephemeral_range():
    """What makes the choice above matter: NIXL's agents take ephemeral ports."""
    before = {port for _, port in listening_sockets(os.getpid())}
    agent = NixlAgent("ports-probe")
    try:
        taken = {port for _, port in listening_sockets(os.getpid())} - before
        assert taken and all(port >= ephemeral_port_floor() for port in taken), taken
    finally:
        agent.close()
