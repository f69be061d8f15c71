"""The floor under a daemon's per-request CPU: a 200-byte message echoed by a process woken for it,
one every 3.3 ms (300/s), and that process's CPU per message. Three shapes of the echoing process:

    select   a blocking select() loop
    uvloop   an asyncio Protocol on uvloop (the daemon's event loop)
    hop      uvloop, the message handed to a second thread, written back with call_soon_threadsafe
             (the daemon's loop thread and data-plane thread)

Usage: .venv/bin/python scripts/echo_floor.py [select|uvloop|hop ...] (default: all three, twice)
"""

from __future__ import annotations

import asyncio
import os
import queue
import select
import socket
import sys
import tempfile
import threading
import time

import uvloop

NUM_MESSAGES, RATE_PER_S, MESSAGE = 3000, 300.0, b"x" * 200


def serve_select(sock: socket.socket) -> None:
    conn, _ = sock.accept()
    while select.select([conn], [], [])[0] and (data := conn.recv(65536)):
        conn.sendall(data)


def serve_uvloop(sock: socket.socket, hop: bool) -> None:
    loop, handed = uvloop.new_event_loop(), queue.SimpleQueue()

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            if hop:
                threading.Thread(target=lambda: [loop.call_soon_threadsafe(transport.write, handed.get())
                                                 for _ in iter(int, 1)], daemon=True).start()

        def data_received(self, data):
            handed.put(data) if hop else self.transport.write(data)

        def connection_lost(self, exc):
            loop.stop()

    loop.run_until_complete(loop.create_unix_server(Echo, sock=sock))
    loop.run_forever()


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="kvx-floor-"), "echo.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen()
    pid = os.fork()
    if pid == 0:
        serve_select(sock) if kind == "select" else serve_uvloop(sock, hop=kind == "hop")
        os._exit(0)
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    time.sleep(0.5)
    start_cpu_s, start_s, rtts_s = cpu_s(pid), time.monotonic(), []
    for n in range(NUM_MESSAGES):
        sent_s = time.perf_counter()
        client.sendall(MESSAGE)
        got = 0
        while got < len(MESSAGE):
            got += len(client.recv(65536))
        rtts_s.append(time.perf_counter() - sent_s)
        time.sleep(max(0.0, (n + 1) / RATE_PER_S - (time.monotonic() - start_s)))
    used_s = cpu_s(pid) - start_cpu_s
    client.close()
    os.waitpid(pid, 0)
    rtts_s.sort()
    return (f"{kind:7s} echoing process CPU {1e6 * used_s / NUM_MESSAGES:5.0f} us/message; round trip p50 "
            f"{1e6 * rtts_s[len(rtts_s) // 2]:4.0f} us, p99 {1e6 * rtts_s[int(len(rtts_s) * 0.99)]:4.0f} us")


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["select", "uvloop", "hop"] * 2:
        print(measure(kind), flush=True)
