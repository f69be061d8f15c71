"""Daemons started by ``DaemonProcess`` listen below the ephemeral port range, so a restart in place gets
its ports back: every NIXL agent asks the kernel for two ephemeral ports (UCX's TCP transport listens on
them), and one of those once took a killed daemon's peer port before the daemon came back."""

import os

from kvxferd.client.launch import NUM_FIXED_PORTS, ephemeral_port_floor, free_ports, port_is_free
from kvxferd.xfer.nixl.agent import NixlAgent
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


def _taken_port(monkeypatch, which: int):
    """Make the first draw of ports hand out a port someone else listens on (as ``which`` of the three)."""
    import socket

    from kvxferd.client import launch

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    draws = []

    def drawn(count, host="127.0.0.1"):
        ports = free_ports(count, host)
        if not draws:
            ports[which] = holder.getsockname()[1]
        draws.append(ports)
        return ports

    monkeypatch.setattr(launch, "free_ports", drawn)
    return holder, draws


def test_a_daemon_whose_drawn_port_was_taken_meanwhile_starts_on_new_ports(monkeypatch, tmp_path):
    """Two processes may draw the same free port before either binds it: the loser starts again."""
    from kvxferd.client.launch import DaemonProcess

    for which in range(3):  # peer (gRPC), notify (ZMQ), metrics (HTTP)
        holder, draws = _taken_port(monkeypatch, which)
        daemon = DaemonProcess(f"race{which}", socket_dir=str(tmp_path), extra_args=("--insecure",))
        try:
            assert len(draws) == 2, draws
            assert str(holder.getsockname()[1]) not in " ".join(daemon.addresses.values())
        finally:
            daemon.terminate()
            holder.close()


def test_a_daemon_restarted_in_place_does_not_move_off_its_given_ports(monkeypatch, tmp_path):
    import pytest

    from kvxferd.client.launch import DaemonProcess

    holder, draws = _taken_port(monkeypatch, 1)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            DaemonProcess("given", socket_dir=str(tmp_path),
                          extra_args=("--insecure", "--notify-port", str(holder.getsockname()[1])))
        assert len(draws) == 1
    finally:
        holder.close()
