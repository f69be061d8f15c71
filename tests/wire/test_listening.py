"""Who listens on a loopback port: the kernel's socket diagnostics (netlink) and /proc/net/tcp give the same
listeners, of either family and any uid; without netlink the /proc answer stands."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from kvxferd.wire import listening
from kvxferd.wire.listening import listener_uids


@pytest.fixture
def listeners():
    """An IPv4 listener on 127.0.0.1 and a dual-stack wildcard of uid 65534 (a child that drops privileges)."""
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen()
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys\nos.setgid(65534); os.setuid(65534)\ns = socket.socket(socket.AF_INET6)\n"
        "s.bind(('::', 0)); s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield own.getsockname()[1], int(child.stdout.readline())
    finally:
        own.close()
        child.stdin.close()
        child.wait(10)


def test_netlink_and_proc_see_the_same_listeners(listeners):
    own_port, other_port = listeners
    for port, expected in ((own_port, [(ipaddress.ip_address("127.0.0.1"), os.getuid())]),
                           (other_port, [(ipaddress.ip_address("::"), 65534)])):
        assert sorted(listening._netlink_listeners(port)) == expected
        assert sorted(listening._proc_listeners(port)) == expected


def test_the_uids_a_loopback_connection_could_reach(listeners):
    own_port, other_port = listeners
    assert listener_uids("127.0.0.1", own_port) == {os.getuid()}
    assert listener_uids("::1", own_port) == set()  # an IPv4 listener is not reached over ::1
    assert listener_uids("127.0.0.1", other_port) == {65534}  # a dual-stack wildcard reaches 127.0.0.1 too
    assert listener_uids("localhost", other_port) == {65534}
    assert listener_uids("198.18.0.1", own_port) is None  # not loopback: cannot tell
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: nobody to reach
        assert listener_uids("127.0.0.1", unused.getsockname()[1]) == set()


def test_without_netlink_proc_answers(listeners, monkeypatch):
    own_port, other_port = listeners

    def no_netlink(port):
        raise PermissionError("netlink refused (a sandbox)")

    monkeypatch.setattr(listening, "_netlink_listeners", no_netlink)
    assert listener_uids("127.0.0.1", own_port) == {os.getuid()}
    assert listener_uids("127.0.0.1", other_port) == {65534}
