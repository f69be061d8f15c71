"""The TCP connections of one port, asked of the kernel, and closing some of this process's.

gRPC's Python server and libzmq accept connections inside themselves: neither
says who is connected, nor closes one connection on request. The kernel knows
both. Its socket diagnostics (netlink ``SOCK_DIAG_BY_FAMILY``, what ``ss -ti``
uses; :mod:`kvxferd.wire.listening` asks :func:`tcp_listeners` too) dump the
connections of one port, filtered by port in the kernel, with each socket's
inode, owner uid and ``tcp_info`` (``tcpi_bytes_received``: what the peer sent
on it so far)::

    request  nlmsghdr(type 20, REQUEST|DUMP) + inet_diag_req_v2(family, TCP, ext=INFO, states, sport|dport)
    answer   nlmsghdr + inet_diag_msg (family, state, sockid, ..., uid, inode) + rtattr INFO (tcp_info) ...
             ... NLMSG_DONE

On loopback both ends of a connection are in that table: the connecting
socket's uid is the user who made it (kernel-given, not claimed). A socket of
this process is found by its inode in ``/proc/self/fd`` and shut down
(``shutdown(SHUT_RDWR)`` on a duplicate of that fd: the library that owns it
sees the connection end and frees what it kept for it; its fd stays its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2  # the rtattr carrying struct tcp_info
# Connected states (TCP_ESTABLISHED 1, FIN_WAIT1 4, FIN_WAIT2 5, CLOSE_WAIT 8, LAST_ACK 9, CLOSING 11): a socket
# the peer half-closed still holds what the server kept for it.
CONNECTED_STATES = sum(1 << s for s in (1, 4, 5, 8, 9, 11))
_TCP_LISTEN = 10
TCP_ESTABLISHED = 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBxI")  # inet_diag_req_v2: family, protocol, ext, pad, states; then a sockid
_SOCKID = struct.Struct(">HH16s16s8x4x")  # sport, dport, src, dst (network order); interface, cookie
_EXACT_SOCKID = struct.Struct(">HH16s16sIII")  # the same, with the interface and the two cookie words
_NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: find the socket by its addresses alone
_MESSAGE_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans
_MESSAGE_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_MESSAGE_BYTES = _MESSAGE_HEAD.size + _SOCKID.size + _MESSAGE_TAIL.size  # 72
_ATTRIBUTE = struct.Struct("=HH")  # rtattr: len, type
_BYTES_RECEIVED = struct.Struct("=Q")  # tcp_info.tcpi_bytes_received (Linux 4.1+)
_BYTES_RECEIVED_AT = 128
_RECV_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class TcpConnection:
    """One TCP socket of a connection, as the kernel sees it (``local`` is this socket's end)."""

    local: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
    remote: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
    state: int  # TCP_ESTABLISHED, or a closing state (CONNECTED_STATES); 10 for a listener
    uid: int
    inode: int
    bytes_received: int  # -1 where the kernel did not say


def tcp_listeners(port: int) -> list[TcpConnection]:
    """The TCP listeners on ``port``, both families (a cheap dump: the kernel walks listeners only; their
    ``remote`` is the unspecified address). Raises OSError where the kernel cannot be asked (no netlink)."""
    found: list[TcpConnection] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN) + _SOCKID.pack(port, 0, b"", b"")
            sock.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                                   seq, 0) + body)
            found += _read_dump(sock, seq)
    # The kernel filtered already; a reply is input all the same.
    return [c for c in found if c.state == _TCP_LISTEN and c.local[1] == port]


def listener_families(port: int) -> tuple[int, ...]:
    """The address families of the TCP listeners on ``port``. gRPC listens on IPv6 sockets even for an IPv4
    address (its clients are then IPv4-mapped IPv6)."""
    found = {socket.AF_INET if c.local[0].version == 4 else socket.AF_INET6 for c in tcp_listeners(port)}
    return tuple(f for f in (socket.AF_INET, socket.AF_INET6) if f in found)


def tcp_connections(port: int, *, remote_port: bool = False,
                    families: tuple[int, ...] = (socket.AF_INET, socket.AF_INET6)) -> list[TcpConnection]:
    """The connected TCP sockets whose local port is ``port`` (a server's accepted connections), or with
    ``remote_port`` whose peer's port is (the connecting ends, on this host). Each family costs the kernel a
    walk of its whole connection table (about 2.5 ms with 256 Ki buckets here): ask only for the listener's
    (:func:`listener_families`). Raises OSError where the kernel cannot be asked (no netlink)."""
    found: list[TcpConnection] = []
    sport, dport = (0, port) if remote_port else (port, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        for seq, family in enumerate(families, 1):
            body = (_REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), CONNECTED_STATES)
                    + _SOCKID.pack(sport, dport, b"", b""))
            sock.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                                   seq, 0) + body)
            found += _read_dump(sock, seq)
    # The kernel filtered by port already; a reply is input all the same.
    return [c for c in found if (c.remote[1] if remote_port else c.local[1]) == port]


def tcp_socket_uid(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid of the TCP socket on this host whose local end is ``local`` and remote end ``remote`` (one
    hash lookup in the kernel, not a dump); None when there is none (it closed, or it is on another host).
    On loopback this names who made the connecting end of a connection this process accepted."""
    local_ip, remote_ip = ipaddress.ip_address(local[0]), ipaddress.ip_address(remote[0])
    if local_ip.version != remote_ip.version:
        return None
    family = socket.AF_INET if local_ip.version == 4 else socket.AF_INET6
    body = (_REQUEST.pack(family, socket.IPPROTO_TCP, 0, CONNECTED_STATES)
            + _EXACT_SOCKID.pack(local[1], remote[1], local_ip.packed, remote_ip.packed, 0, _NO_COOKIE, _NO_COOKIE))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body)
        data = sock.recv(_RECV_BYTES)
    if len(data) < _HEADER.size:
        raise OSError("netlink: a reply shorter than its header")
    length, kind = _HEADER.unpack_from(data)[:2]
    if kind == NLMSG_ERROR:
        (errno,) = struct.unpack_from("=i", data, _HEADER.size)
        if -errno == 2:  # ENOENT: no such socket
            return None
        raise OSError(-errno, "netlink: the socket diagnostics request failed")
    if kind != SOCK_DIAG_BY_FAMILY or length < _HEADER.size + _MESSAGE_BYTES or len(data) < length:
        raise OSError("netlink: an unexpected reply")
    return _connection(data[_HEADER.size:length]).uid


def _read_dump(sock: socket.socket, seq: int) -> list[TcpConnection]:
    found = []
    while True:
        data = sock.recv(_RECV_BYTES)
        if not data:
            raise OSError("netlink: the dump ended without NLMSG_DONE")
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, kind, _flags, reply_seq, _pid = _HEADER.unpack_from(data, offset)
            if length < _HEADER.size or offset + length > len(data):
                raise OSError("netlink: a message longer than what came, or shorter than its header")
            if reply_seq == seq:
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                    raise OSError(-errno, "netlink: the socket diagnostics request failed")
                if kind == SOCK_DIAG_BY_FAMILY and length >= _HEADER.size + _MESSAGE_BYTES:
                    found.append(_connection(data[offset + _HEADER.size: offset + length]))
            offset += (length + 3) & ~3


def _connection(message: bytes) -> TcpConnection:
    family, state = _MESSAGE_HEAD.unpack_from(message)[:2]
    sport, dport, src, dst = _SOCKID.unpack_from(message, _MESSAGE_HEAD.size)
    uid, inode = _MESSAGE_TAIL.unpack_from(message, _MESSAGE_HEAD.size + _SOCKID.size)[3:]
    size = 4 if family == socket.AF_INET else 16
    bytes_received, at = -1, _MESSAGE_BYTES
    while at + _ATTRIBUTE.size <= len(message):  # the attributes: INFO is the one asked for
        attr_len, attr_type = _ATTRIBUTE.unpack_from(message, at)
        if attr_len < _ATTRIBUTE.size:
            break
        info = message[at + _ATTRIBUTE.size: at + attr_len]
        if attr_type == INET_DIAG_INFO and len(info) >= _BYTES_RECEIVED_AT + _BYTES_RECEIVED.size:
            (bytes_received,) = _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)
        at += (attr_len + 3) & ~3
    return TcpConnection((ipaddress.ip_address(src[:size]), sport), (ipaddress.ip_address(dst[:size]), dport),
                         state, uid, inode, bytes_received)


def shut_down_own_sockets(inodes: set[int]) -> int:
    """Shut down (both ways) every socket of this process whose inode is in ``inodes``; how many were.

    Each is found in ``/proc/self/fd`` and shut down through a duplicate whose inode is checked again: an
    fd number the owning library closed and reused meanwhile is never touched."""
    if not inodes:
        return 0
    done = 0
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            if not (target.startswith("socket:[") and int(target[8:-1]) in inodes):
                continue
            try:
                duplicate = os.dup(int(name))
            except OSError:
                continue
            try:
                if os.fstat(duplicate).st_ino in inodes:
                    with socket.socket(fileno=duplicate) as sock:
                        duplicate = -1  # the socket object closes it
                        sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:
                pass  # the peer left already
            finally:
                if duplicate >= 0:
                    os.close(duplicate)
    return done
