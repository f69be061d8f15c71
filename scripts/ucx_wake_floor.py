"""Issue #58's floor: a READ between two namespace hosts (UCX over TCP on a veth link, as `bench daemon
--hosts`) against how the holder makes progress, and the holder's CPU.

A holder process on h0 registers 4 MiB with a NIXL agent; a reader on h1 READs 64 bytes 300 times,
then 256 KiB 300 times, at 300/s, checking its transfer every 20 µs (SPIN_SLEEP; 0: a busy loop). The
holder's regimes (arguments, several in one run, alternate them):

    poll:<s>     Python polls the agent every <s> seconds (the data plane's timer before issue #58: 0.001)
    fd:<s>       Python sleeps on the agent's socket sets (kvxferd.xfer.osutil.ucxwake), <s> at most
    thread:<ms>  NIXL's own progress thread, its poll() timeout <ms> (it sleeps on the same sockets)

Prints per regime the READ latencies and the holder's CPU: idle (% of a core) and per READ (µs).
FLOOR_UCX="UCX_TCP_TX_SEG_SIZE=64k,..." adds UCX settings to both sides. Needs root (namespaces).

Usage: .venv/bin/python scripts/ucx_wake_floor.py poll:0.001 fd:0.05 thread:50
"""

from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvxferd.rig.bench import nixl_progress  # noqa: E402
from kvxferd.rig.bench.common import percentiles_us, process_cpu_s  # noqa: E402
from kvxferd.xfer.osutil.ucxwake import socket_sets_made_by  # noqa: E402

WORKDIR = "/tmp/kvx-ucx-wake-floor"
SPIN_SLEEP_S = float(os.environ.get("SPIN_SLEEP", "20e-6"))
MARKS = ("idle0", "run0", "mid", "run1", "idle1")
SIZES = (64, 256 << 10)
NUM_READS = 300


def _ucx_environment() -> dict[str, str]:
    extra = dict(kv.split("=", 1) for kv in os.environ.get("FLOOR_UCX", "").split(",") if kv)
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_TCP_PORT_RANGE": "30000-30100", **extra}


def holder(regime: str) -> None:
    kind, value = regime.split(":")
    if kind == "thread":
        nixl_progress.DELAY_US = int(value) * 1000
    agent, sets = socket_sets_made_by(lambda: nixl_progress.make_agent("holder", progress_thread=kind == "thread"))
    memory = np.ones(4 << 20, np.uint8)
    agent.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")
    with open(f"{WORKDIR}/holder.tmp", "wb") as out:
        pickle.dump((agent.get_agent_metadata(), memory.ctypes.data), out)
    os.rename(f"{WORKDIR}/holder.tmp", f"{WORKDIR}/holder.meta")
    marks: dict[str, tuple[float, float]] = {}
    looked_s = 0.0
    while True:
        if time.perf_counter() - looked_s < 0.05:  # the loop itself as lean as the daemon's
            agent.get_new_notifs()
            if kind == "fd":
                select.select(list(sets), [], [], float(value))
            else:
                time.sleep(float(value) if kind == "poll" else 0.05)
            continue
        looked_s = time.perf_counter()
        for mark in MARKS:
            if mark not in marks and os.path.exists(f"{WORKDIR}/{mark}"):
                marks[mark] = (process_cpu_s(), time.perf_counter())
        if os.path.exists(f"{WORKDIR}/stop"):
            break
    with open(f"{WORKDIR}/holder.json", "w") as out:
        json.dump(marks, out)


def _mark(name: str) -> None:
    open(f"{WORKDIR}/{name}", "w").close()
    time.sleep(0.2)


def reader() -> None:
    while not os.path.exists(f"{WORKDIR}/holder.meta"):
        time.sleep(0.05)
    with open(f"{WORKDIR}/holder.meta", "rb") as meta:
        metadata, address = pickle.load(meta)
    agent = nixl_progress.make_agent("reader", progress_thread=False)
    memory = np.zeros(4 << 20, np.uint8)
    agent.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(metadata)

    def one(num_bytes: int) -> float:
        local = agent.get_xfer_descs([(memory.ctypes.data, num_bytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(address, num_bytes, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, name)
        start = time.perf_counter()
        agent.transfer(handle)
        while agent.check_xfer_state(handle) == "PROC":
            if SPIN_SLEEP_S:
                time.sleep(SPIN_SLEEP_S)
        took_s = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        return took_s

    for _ in range(20):  # the connection set up
        one(64)
    _mark("idle0")
    time.sleep(2.0)
    _mark("run0")
    figures = {}
    for num_bytes in SIZES:
        took = []
        for _ in range(NUM_READS):
            took.append(one(num_bytes))
            time.sleep(1 / 300)
        figures[str(num_bytes)] = percentiles_us(took)
        if num_bytes == SIZES[0]:
            _mark("mid")
    _mark("run1")
    time.sleep(2.0)
    _mark("idle1")
    with open(f"{WORKDIR}/reader.json", "w") as out:
        json.dump(figures, out)


def main(regimes: list[str]) -> None:
    from kvxferd.rig.verify.hosts.fabric import Fabric

    environment = {**os.environ, **_ucx_environment()}
    with Fabric(2) as fabric:
        for regime in regimes:
            shutil.rmtree(WORKDIR, ignore_errors=True)
            os.makedirs(WORKDIR)
            serving = subprocess.Popen(fabric.command(fabric.hosts[0], sys.executable, __file__, "holder", regime),
                                       env=environment)
            subprocess.run(fabric.command(fabric.hosts[1], sys.executable, __file__, "reader"), env=environment,
                           timeout=120, check=True)
            _mark("stop")
            serving.wait(timeout=30)
            with open(f"{WORKDIR}/holder.json") as f:
                marks = json.load(f)
            with open(f"{WORKDIR}/reader.json") as f:
                latencies = json.load(f)

            def cpu(a: str, b: str) -> float:
                return marks[b][0] - marks[a][0]

            idle_pct = cpu("idle0", "run0") / (marks["run0"][1] - marks["idle0"][1]) * 100
            row = {f"read_{n}_bytes_us": {k: round(v) for k, v in latencies[str(n)].items()} for n in SIZES}
            row.update(holder_idle_percent=round(idle_pct, 2),
                       holder_cpu_us_per_64_byte_read=round(cpu("run0", "mid") / NUM_READS * 1e6),
                       holder_cpu_us_per_256_kib_read=round(cpu("mid", "run1") / NUM_READS * 1e6))
            print(regime, json.dumps(row), flush=True)
    shutil.rmtree(WORKDIR, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "holder":
        holder(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "reader":
        reader()
    else:
        main(sys.argv[1:] or ["poll:0.001", "fd:0.05", "thread:50"])
