"""The kernel's view of one port's connections (netlink socket diagnostics), and shutting down our own."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvxferd.service.net.peerport import ConnectionCap
from kvxferd.wire.connections import (TCP_ESTABLISHED, listener_families, shut_down_own_sockets, tcp_connections,
                                      tcp_socket_uid)


@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    clients, accepted = [], []
    yield listener, clients, accepted
    for sock in (listener, *clients, *accepted):
        sock.close()


def _connect(server, count: int) -> None:
    listener, clients, accepted = server
    for _ in range(count):
        clients.append(socket.create_connection(listener.getsockname()))
        accepted.append(listener.accept()[0])


def test_connections_bytes_and_uids(server):
    listener, clients, accepted = server
    port = listener.getsockname()[1]
    _connect(server, 3)
    clients[1].sendall(b"x" * 5000)
    time.sleep(0.05)
    assert listener_families(port) == (socket.AF_INET,)
    connections = tcp_connections(port, families=listener_families(port))
    by_inode = {c.inode: c for c in connections}
    assert sorted(by_inode) == sorted(os.fstat(s.fileno()).st_ino for s in accepted)
    received = {c.remote[1]: c.bytes_received for c in connections}
    assert received == {s.getsockname()[1]: (5000 if n == 1 else 0) for n, s in enumerate(clients)}
    assert all(c.state == TCP_ESTABLISHED and c.uid == os.getuid() for c in connections)
    # The connecting end, found by its addresses: its uid (the one who made it).
    assert tcp_socket_uid(clients[0].getsockname(), ("127.0.0.1", port)) == os.getuid()
    assert tcp_socket_uid(("127.0.0.1", 1), ("127.0.0.1", port)) is None


def test_shut_down_own_sockets_ends_only_those_named(server):
    _connect(server, 2)
    _, clients, accepted = server
    assert shut_down_own_sockets({os.fstat(accepted[0].fileno()).st_ino, 1}) == 1
    clients[0].settimeout(2)
    assert clients[0].recv(10) == b""  # the peer sees the end
    clients[1].sendall(b"still")
    assert accepted[1].recv(10) == b"still"


def test_the_cap_closes_the_newest_past_it_per_source(server):
    listener, clients, accepted = server
    cap = ConnectionCap(3)
    cap.port = listener.getsockname()[1]
    _connect(server, 2)
    assert cap.check() == 0  # the first two are seen first
    _connect(server, 3)
    assert cap.check() == 2  # one source (this uid): of the three new ones, two go
    time.sleep(0.05)
    ended = [_ended(c) for c in clients]
    assert ended[:2] == [False, False] and sum(ended[2:]) == 2, ended


def _ended(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
