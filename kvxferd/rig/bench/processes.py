"""What splitting the daemon into a control plane and data-plane workers costs alone (issue #55).

    kvxferd bench processes [--json]

* a question to another process: a 200-byte message each way on a
  ``SOCK_SEQPACKET`` socket pair, the other process blocked in ``recv``
  (what a worker pays to ask the control plane one thing per read), back to
  back and one every 3 ms (the engine's pace at 300 requests/s: the
  partner's CPU has gone cold);
* an fd handed over: one descriptor with ``SCM_RIGHTS`` and its answer (a
  reads-socket connection the control plane authenticated, or an engine's
  shared memory, given to a worker);
* a worker's start: a fresh interpreter (``exec``, never a fork of the
  control plane: that would copy its heap, secrets included) that imports
  NIXL, opens a shared-memory cache it gets as an fd, maps it, registers it
  with a new agent and answers with the agent's metadata; how long until
  the answer, and the worker's resident memory then.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import time

from kvxferd.rig.attack.metadata import registered_ranges
from kvxferd.rig.bench.common import bench_main, percentiles_us, process_cpu_s

MESSAGE_BYTES = 200
CACHE_BYTES = 256 << 20  # the worker's start maps and registers this much


def serve_echo(fd: int) -> None:
    """Body of the partner process: every message back as it came, the fds it carried closed."""
    sock = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        if not message:
            return
        for passed in fds:
            os.close(passed)
        sock.send(message)


def _partner() -> tuple[socket.socket, subprocess.Popen]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = f"from kvxferd.rig.bench.processes import serve_echo; serve_echo({theirs.fileno()})"
    process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),))
    theirs.close()
    return ours, process


def _trips(sock: socket.socket, repeat: int, gap_s: float, fds: list[int]) -> dict:
    message, trips = b"q" * MESSAGE_BYTES, []
    cpu_start = process_cpu_s()
    for _ in range(repeat):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        if fds:
            socket.send_fds(sock, [message], fds)
        else:
            sock.send(message)
        sock.recv(1 << 16)
        trips.append(time.perf_counter() - start)
    row = percentiles_us(trips[len(trips) // 10:])
    row["cpu_us_asker"] = (process_cpu_s() - cpu_start) / repeat * 1e6
    return row


def questions(repeat: int = 2000, gap_s: float = 3e-3) -> dict:
    """Round trips of one message to a process blocked in ``recv``, and of one fd handed over."""
    sock, process = _partner()
    passed = os.open("/dev/null", os.O_RDONLY)
    try:
        return {"back_to_back": _trips(sock, repeat, 0.0, []), f"every_{gap_s * 1e3:g}_ms": _trips(sock, repeat // 4, gap_s, []),
                "fd_passed": _trips(sock, repeat, 0.0, [passed])}
    finally:
        os.close(passed)
        sock.close()
        process.wait(timeout=10)


def serve_worker(fd: int) -> None:
    """Body of a started worker: map the shared memory it was given, register it, answer with the metadata."""
    import numpy as np  # these imports are part of what a start costs

    from kvxferd.xfer.nixl.agent import NixlAgent

    sock = socket.socket(fileno=fd)
    _, fds, _, _ = socket.recv_fds(sock, 64, 1)
    cache = np.frombuffer(mmap.mmap(fds[0], CACHE_BYTES), dtype=np.uint8)
    agent = NixlAgent(f"kvx-worker-{os.getpid()}")
    agent.register_array("cache", cache)
    sock.send(agent.metadata())
    sock.recv(1)  # until told to go


def worker_start(repeat: int = 3) -> dict:
    """Seconds from ``exec`` until a worker answers with its metadata; its resident memory then (MiB), and
    the bytes its metadata says it registered."""
    starts, rss, registered = [], [], []
    shm = os.memfd_create("kvx-bench-cache")
    os.ftruncate(shm, CACHE_BYTES)
    try:
        for _ in range(repeat):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            start = time.perf_counter()
            code = f"from kvxferd.rig.bench.processes import serve_worker; serve_worker({theirs.fileno()})"
            process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            theirs.close()
            socket.send_fds(ours, [b"cache"], [shm])
            metadata = ours.recv(1 << 20)
            starts.append(time.perf_counter() - start)
            with open(f"/proc/{process.pid}/status") as status:
                rss.append(next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024)
            registered.append(sum(r.num_bytes for r in registered_ranges(metadata)))
            ours.send(b"x")
            process.wait(timeout=30)
            ours.close()
    finally:
        os.close(shm)
    return {"start_s": sorted(starts), "rss_mib": sorted(rss), "cache_bytes": CACHE_BYTES,
            "registered_bytes": registered}


def run() -> dict:
    return {"questions": questions(), "worker_start": worker_start()}


def format_table(f: dict) -> str:
    lines = [f"{'step':<58}{'p50 us':>9}{'p99 us':>9}{'asker CPU us':>14}"]
    for key, row in f["questions"].items():
        label = f"{MESSAGE_BYTES} B each way, other process in recv, {key.replace('_', ' ')}"
        lines.append(f"{label:<58}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}{row['cpu_us_asker']:>14.1f}")
    w = f["worker_start"]
    lines.append(f"worker start (exec, import NIXL, map + register {w['cache_bytes'] >> 20} MiB, metadata): "
                 + ", ".join(f"{s:.2f}" for s in w["start_s"]) + " s; resident "
                 + ", ".join(f"{m:.0f}" for m in w["rss_mib"]) + " MiB")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run()
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.processes", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
