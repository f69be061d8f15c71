"""The soak's data-plane worker fault (``--dataplane-workers``): kill -9 of one daemon's worker.

What must hold (issue #55)::

    kill -9 worker of daemon D ─► D lives on (daemon_alive), its holds stay (hold_ends_once)
                                ─► a new worker of D within WORKER_BACK_S (workers_alive)
                                ─► reads it was serving fail with their block ids (bytes_right), or
                                   succeed; the stream to the engine never breaks (completion_in_time)
    and at every pairing's end: each daemon life counted exactly the worker deaths the soak caused,
    and no supervisor gave up.
"""

from __future__ import annotations

import collections
import os
import signal
import time

from kvxferd.rig.daemons import DaemonLife, dataplane_workers

WORKER_BACK_S = 30.0  # a killed worker's successor is up within this (2-3 s on loopback here)
DEATHS = "kvxferd_dataplane_worker_deaths_total"
GIVEN_UP = "kvxferd_dataplane_workers_given_up"


class WorkerKills:
    """Workers killed per daemon life (by pid), and the checks that each was replaced and nothing else died."""

    def __init__(self, report) -> None:
        self.report = report
        self.kills: collections.Counter = collections.Counter()  # daemon pid -> workers the soak killed

    def kill(self, life: DaemonLife, pick) -> tuple[int, int] | None:
        """kill -9 one of ``life``'s workers (``pick(n)``: which of n); its pid and where the daemon's log
        stood, or None when none is up (its last one's successor still starting, or it just ended)."""
        pid = life.daemon.process.pid
        workers = sorted(dataplane_workers(pid))
        if not workers:
            return None
        worker, log_at = workers[pick(len(workers))], life.daemon.log_bytes()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.report.log(f"  kill -9 worker {worker} of {life.daemon.daemon_id}")
        self.kills[pid] += 1
        return worker, log_at

    def wait_back(self, life: DaemonLife, killed: tuple[int, int]) -> None:
        """A worker other than the killed one serves ``life`` again (the supervisor logged its successor up,
        after the kill), within WORKER_BACK_S."""
        (worker, log_at), pid, start = killed, life.daemon.process.pid, time.monotonic()
        while time.monotonic() - start < WORKER_BACK_S:
            workers = dataplane_workers(pid)
            if workers and worker not in workers and ") is up after" in life.daemon.log_text(log_at):
                self.report.figure("worker_back_s", time.monotonic() - start)
                return
            time.sleep(0.2)
        self.report.violate("workers_alive", f"{life.daemon.daemon_id}: no new worker {WORKER_BACK_S:g} s after "
                                             f"worker {worker} was killed")

    def check(self, lives: list[DaemonLife]) -> None:
        """Each live daemon counted exactly the worker deaths the soak caused in its life, and gave up on none."""
        for life in lives:
            if life.daemon.process.poll() is not None or life.stopped_since is not None:
                continue
            pid = life.daemon.process.pid
            deaths, given_up = life.daemon.metric(DEATHS), life.daemon.metric(GIVEN_UP)
            if deaths != self.kills[pid] or given_up:
                self.report.violate("workers_alive", f"{life.daemon.daemon_id}: {deaths:g} worker deaths counted, "
                                                     f"{self.kills[pid]} killed by the soak; {given_up:g} given up")
                self.kills[pid] = int(deaths)  # each surplus death is reported once
