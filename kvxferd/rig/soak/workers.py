"""The soak's data-plane worker faults (``--dataplane-workers``): kill -9 of one daemon's worker, and (on
namespace hosts, whose daemons use mutual TLS) a CA bundle that changes under every daemon.

What must hold (issue #55)::

    kill -9 worker of daemon D ─► D lives on (daemon_alive), its holds stay (hold_ends_once)
                                ─► a new worker of D within WORKER_BACK_S (workers_alive)
                                ─► reads it was serving fail with their block ids (bytes_right), or
                                   succeed; the stream to the engine never breaks (completion_in_time)
    and at every pairing's end: each daemon life counted exactly the worker deaths the soak caused,
    and no supervisor gave up.

    rotate_ca ─► (a CA withdrawn from the bundle; one added ends no trust and replaces nothing)
              ─► every awake daemon with a worker serves from a generation up since the change (it
                 replaced its worker, make before break, or folded the change into a start under way)
                 within REPLACED_S; the read in flight meanwhile is byte-exact or fails with its block ids
"""

from __future__ import annotations

import collections
import os
import signal
import time

from kvxferd.rig.daemons import DaemonLife, dataplane_workers
from kvxferd.rig.verify.certs import DevCA

WORKER_BACK_S = 30.0  # a killed worker's successor is up within this (2-3 s on loopback here)
DEATHS = "kvxferd_dataplane_worker_deaths_total"
GIVEN_UP = "kvxferd_dataplane_workers_given_up"
REPLACED_S = 40.0  # TLS files are looked at every 1 s, replacements 3 s apart (the soak's flags), a start


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
            workers, logged = dataplane_workers(pid), life.daemon.log_text(log_at)
            # A replaced worker killed while it retired has its successor serving already.
            if workers and worker not in workers and (") is up after" in logged or "replaced) ended" in logged):
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
                                                     f"{self.kills[pid]} killed by the soak; {given_up:g} given up"
                                                     + why_workers_died(life.daemon.log_text(0)))
                self.kills[pid] = int(deaths)  # each surplus death is reported once


def why_workers_died(log: str, most: int = 3) -> str:
    """The daemon's own lines on worker ends that were not the soak's kill -9 (their exit codes or signals,
    a worker killed for breaking the protocol or leaving its channel full), for a violation to say why."""
    lines = [line for line in log.splitlines()
             if ("ended with" in line and "ended with -9" not in line) or "killing it" in line]
    return "".join(f"\n      {line[:300]}" for line in lines[-most:]) if lines else " (the log says nothing more)"


class CaRotations:
    """rotate_ca: the bundle every daemon verifies peers with (``ca_path``) gains a second CA, next time
    loses it again; each daemon must replace its workers (``ca_changed``) and count no death for it."""

    def __init__(self, report, ca_path: str, workdir: str) -> None:
        self.report, self.ca_path = report, ca_path
        with open(ca_path, "rb") as ca:
            fabric = ca.read()
        extra = DevCA(os.path.join(workdir, "pki-extra"), name="kvxferd extra CA").cert_path.read_bytes()
        self.bundles = (fabric, fabric + extra)  # the fabric CA stays in both: every handshake still passes
        self.num_rotations = 0

    def rotate(self, lives: list[DaemonLife]) -> tuple[str, dict[int, tuple[DaemonLife, int]]]:
        """Change the bundle. What each daemon must log next (a CA added: that it loaded the bundle, or
        the withdrawal that follows would look like no change to it; withdrawn: a worker generation up),
        and per daemon that must, by pid: its life and its log's length."""
        before = {}
        for life in lives:
            pid = life.daemon.process.pid
            if life.daemon.process.poll() is None and life.stopped_since is None and dataplane_workers(pid):
                before[pid] = (life, life.daemon.log_bytes())
        self.num_rotations += 1
        with open(self.ca_path + ".new", "wb") as bundle:
            bundle.write(self.bundles[self.num_rotations % 2])
        os.replace(self.ca_path + ".new", self.ca_path)  # whole at once: a daemon never reads half a bundle
        added = self.num_rotations % 2 == 1
        self.report.log(f"  CA bundle {'with' if added else 'without'} a second CA")
        return ("TLS files reloaded" if added else ") is up after"), before

    def wait_replaced(self, expected: tuple[str, dict[int, tuple[DaemonLife, int]]]) -> None:
        """Every daemon still in the life it had and awake logged what :meth:`rotate` said, within
        REPLACED_S: after a withdrawal, a worker generation came up since (a replacement, or a start under
        way that the change was folded into; one rank per daemon in the soak)."""
        needle, pending = expected[0], dict(expected[1])
        start = time.monotonic()
        while pending and time.monotonic() - start < REPLACED_S:
            for pid, (life, log_at) in list(pending.items()):
                if life.daemon.process.pid != pid or life.daemon.process.poll() is not None or life.stopped_since:
                    del pending[pid]  # killed or frozen meanwhile: a new life starts with the new bundle
                elif needle in life.daemon.log_text(log_at):
                    del pending[pid]
            time.sleep(0.2)
        if not pending and needle != "TLS files reloaded":
            self.report.figure("workers_replaced_s", time.monotonic() - start)
        for life, _ in pending.values():
            self.report.violate("workers_alive", f"{life.daemon.daemon_id}: not {needle!r} {REPLACED_S:g} s "
                                                 "after the CA bundle changed")
