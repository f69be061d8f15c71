"""What a test process learns about listening sockets from /proc."""

from __future__ import annotations

import os


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(local address, port)`` of every listening TCP socket process ``pid`` holds; the address in hex,
    as /proc/net/tcp{,6} writes it."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in lines.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, port = fields[1].split(":")
                    found.append((address, int(port, 16)))
    return found
