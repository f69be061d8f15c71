"""Who listens on a loopback TCP port: the uids of its listeners, asked of the kernel.

A daemon sends its peer token only to a loopback listener of its own user
(wire/peerauth.py), and asks before every peer call. Reading /proc/net/tcp
for that costs 15-35 ms on a host with a few hundred sockets (the kernel
walks its whole connection table to write the file; measured in
docs/benchmarks.md), on the event loop, every probe. The kernel's socket
diagnostics (netlink ``SOCK_DIAG_BY_FAMILY``, what ``ss -lt`` uses) dump
only listening sockets, filtered by port in the kernel::

    request  nlmsghdr(type 20, REQUEST|DUMP) + inet_diag_req_v2(family, TCP, states=1<<LISTEN, sport)
    answer   nlmsghdr + inet_diag_msg per listener: family, state, sockid (sport, src), ..., uid
             ... NLMSG_DONE

The request is 72 bytes, built here with ``struct``: pyroute2's DiagSocket
does the same, but its own docstring says its signature will change. Where
netlink is unavailable (a sandbox without it), /proc/net/tcp still answers.
"""

from __future__ import annotations

import ipaddress

from kvxferd.wire.connections import tcp_listeners

_PROC_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listener_uids(host: str, port: int) -> set[int] | None:
    """The uids of the TCP listeners a connection to loopback ``host``:``port`` could reach (exact address
    or wildcard, both families); None when ``host`` is not loopback (no way to tell) or the kernel cannot
    be asked (no netlink and no /proc)."""
    host = host.strip("[]")
    try:
        wanted = ({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")} if host == "localhost"
                  else {ipaddress.ip_address(host)})
    except ValueError:
        return None
    if not all(a.is_loopback for a in wanted):
        return None
    wanted |= {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    wanted |= {ipaddress.ip_address(f"::ffff:{a}") for a in wanted if a.version == 4}
    try:
        listeners = _netlink_listeners(port)
    except OSError:
        listeners = _proc_listeners(port)
    if listeners is None:
        return None
    return {uid for address, uid in listeners if address in wanted}


def _netlink_listeners(port: int) -> list[tuple[ipaddress._BaseAddress, int]]:
    """(address, uid) of every TCP listener on ``port``, both families, from the kernel's socket diagnostics."""
    return [(listener.local[0], listener.uid) for listener in tcp_listeners(port)]


def _proc_listeners(port: int) -> list[tuple[ipaddress._BaseAddress, int]] | None:
    """The same from /proc/net/tcp{,6} (slow: see the module doc); None without /proc."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            if table.endswith("6"):
                continue
            return None
        for row in rows:
            fields = row.split()
            address, _, port_hex = fields[1].partition(":")
            if fields[3] == _PROC_LISTEN and int(port_hex, 16) == port:
                found.append((_proc_address(address), int(fields[7])))
    return found


def _proc_address(text: str) -> ipaddress._BaseAddress:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))

