"""The soak's daemons: one ``kvxferd serve`` per rank, killed, frozen and restarted at the same addresses.

Each daemon is started once on free ports; a restart passes the same
engine socket, peer, notify and metrics ports, as a pod restarted behind
the same Service would. What a surviving daemon uses is measured from
``/proc`` (fds, shared-memory mappings, threads, RSS) to find leaks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxferd.client import DaemonProcess


@dataclass
class DaemonLife:
    """One rank's daemon and what happened to it."""

    daemon: DaemonProcess
    role: str  # prefill | decode
    index: int  # rank within its role
    start_again: Callable[[DaemonProcess], DaemonProcess]  # a new daemon at the old one's addresses
    stopped_since: float | None = None
    frozen: list[tuple[float, float]] = field(default_factory=list)  # (SIGSTOP, SIGCONT) monotonic times

    def frozen_during(self, start_s: float, end_s: float) -> float:
        """Seconds this daemon was frozen between ``start_s`` and ``end_s``."""
        spans = self.frozen + ([(self.stopped_since, end_s)] if self.stopped_since is not None else [])
        return sum(max(0.0, min(end_s, stop) - max(start_s, begin)) for begin, stop in spans)


class DaemonSet:
    """Prefill daemons (one per rank) and one or more sets of decode daemons, of which one serves now."""

    def __init__(self, prefill: list[DaemonLife], decode_sets: list[list[DaemonLife]]) -> None:
        self.prefill, self.decode_sets = prefill, decode_sets
        self.current = 0  # the decode set the pairing uses (--hosts: decode hosts take turns)

    @classmethod
    def loopback(cls, num_prefill: int, num_decode: int, workdir: str, daemon_args: tuple[str, ...]) -> "DaemonSet":
        """Every daemon on this host's loopback, in one work directory."""
        ids = [f"soak-p{q}" for q in range(num_prefill)] + [f"soak-d{r}" for r in range(num_decode)]
        started = DaemonProcess.start_many(ids, socket_dir=workdir, extra_args=daemon_args)

        def again(old: DaemonProcess) -> DaemonProcess:
            return DaemonProcess(old.daemon_id, socket_dir=workdir, extra_args=(*daemon_args, *old.port_args()),
                                 ready_timeout_s=60)

        return cls([DaemonLife(d, "prefill", q, again) for q, d in enumerate(started[:num_prefill])],
                   [[DaemonLife(d, "decode", r, again) for r, d in enumerate(started[num_prefill:])]])

    @property
    def decode(self) -> list[DaemonLife]:
        return self.decode_sets[self.current]

    @property
    def all(self) -> list[DaemonLife]:
        return self.prefill + [life for lives in self.decode_sets for life in lives]

    def kill(self, life: DaemonLife) -> None:
        """``kill -9``: no drain, no goodbye; sockets and shared-memory mappings die with it."""
        life.daemon.kill()
        life.stopped_since = None

    def restart(self, life: DaemonLife) -> float:
        """A new daemon at the killed one's addresses; seconds until it is ready."""
        old = life.daemon
        start = time.monotonic()
        for attempt in range(20):  # the old sockets may linger a moment after kill -9
            try:
                life.daemon = life.start_again(old)
                break
            except RuntimeError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        return time.monotonic() - start

    def stop(self, life: DaemonLife) -> None:
        """SIGSTOP: the daemon hangs (a frozen peer, a partition) until :meth:`cont`."""
        os.kill(life.daemon.process.pid, signal.SIGSTOP)
        life.stopped_since = time.monotonic()

    def cont(self, life: DaemonLife) -> None:
        if life.stopped_since is not None:
            os.kill(life.daemon.process.pid, signal.SIGCONT)
            life.frozen.append((life.stopped_since, time.monotonic()))
            life.stopped_since = None

    def crashed(self) -> list[str]:
        """Daemons that exited although nothing killed them (each life is checked)."""
        return [f"{life.daemon.daemon_id} exited with {life.daemon.process.poll()}: {life.daemon.tail(600)}"
                for life in self.all if life.daemon.process.poll() is not None]

    def close(self) -> None:
        for life in self.all:
            self.cont(life)
            life.daemon.terminate()


def usage(pid: int) -> dict[str, int]:
    """What one process holds: open fds, threads, resident bytes, and its shared-memory mappings: engine
    arenas (``psm_*``, which must be gone once no engine is registered) and the rest (UCX's own segments)."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    kinds: dict[str, int] = {}
    fds = os.listdir(f"/proc/{pid}/fd")
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target else ("/dev/shm" if target.startswith("/dev/shm") else "file")
        kinds[kind] = kinds.get(kind, 0) + 1
    with open(f"/proc/{pid}/maps") as maps:
        shm = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/" in line}
    engine_shm = sorted(name for name in shm if "/dev/shm/psm_" in name)
    return {"fds": len(fds), "engine_shm": engine_shm,
            "other_shm_mappings": len(shm) - len(engine_shm), "fd_kinds": kinds,
            "threads": int(fields["Threads"]), "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024}


def measure(life: DaemonLife) -> dict:
    """What a daemon holds now, with its pid (a new pid is a new life) and its registered engines."""
    pid = life.daemon.process.pid
    return {"pid": pid, **usage(pid), "engines_registered": life.daemon.metric("kvxferd_engines_registered")}


# What a surviving daemon may grow by between the first pairing and the end of the run: peer channels
# and UCX endpoints to daemons restarted since, allocator slack. Anything per request would exceed it.
LEAK_SLACK = {"fds": 16, "threads": 4, "rss_bytes": 64 << 20, "other_shm_mappings": 4}


def leaks(start: dict | None, end: dict) -> list[str]:
    """What a daemon holds at the end that it should not, with no engine registered."""
    problems = []
    if end["engine_shm"] or end["engines_registered"]:
        problems.append(f"engine memory {end['engine_shm']} and {end['engines_registered']:g} engines registered "
                        f"with no engine left")
    if start is not None and start["pid"] == end["pid"]:  # a killed daemon's new life has nothing to compare with
        problems += [f"{key} {start[key]} -> {end[key]} (allowed +{slack})"
                     for key, slack in LEAK_SLACK.items() if end[key] - start[key] > slack]
    return problems
