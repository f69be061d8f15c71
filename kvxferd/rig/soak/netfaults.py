"""Network faults in the soak (``--hosts``): windows of a few seconds during which requests go on.

===========  ================================================================
kind         what happens (verify/hosts/linkfaults.py does it to packets)
===========  ================================================================
link_down    the prefill or the decode host's cable is pulled
loss         5-30 % of the packets in and out of one host's link are dropped
delay        packets arriving at one host wait 20-100 ms (+ up to 10 ms jitter)
reorder      packets arriving at one host wait 10-30 ms, and 25-50 % of them
             go in at once instead, overtaking the held ones
partition    the prefill host and the pairing's decode host drop each
             other's packets; both still reach every other host
===========  ================================================================

While a window is open and until reads succeed again, no other fault is
drawn, so what the figures measure is this fault alone::

    inject ──── reads go on (fail or slow) ──── clear ──── first good read
      │◄─ detected_s: first failed read ─►│              │◄─ recovered_s ─►│

A window in which no read failed counts as ``<kind>_absorbed`` (TCP carried
the reads through it). A read aborted mid-transfer fails only once its
transfer ended (UCX cannot stop it; the daemon's ``abort_drain_s``), so a
read that overlapped a broken link usually fails just after the repair.
Reads that do not come back within RECOVERY_BOUND_S of the clear break the
``recovery`` invariant.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from kvxferd.rig.soak.report import Report
from kvxferd.rig.verify.hosts.fabric import Host
from kvxferd.rig.verify.hosts.linkfaults import LinkFaults

WINDOW_S = (1.0, 4.0)
RECOVERY_BOUND_S = 30.0


@dataclasses.dataclass
class Window:
    """One network fault: where, since when, until when, and what the reads saw."""

    kind: str
    hosts: tuple[Host, ...]
    start_s: float
    end_s: float
    cleared_s: float | None = None
    detected: bool = False


class NetworkFaults:
    """Opens, closes and measures network fault windows."""

    def __init__(self, links: LinkFaults, report: Report, rng: np.random.Generator) -> None:
        self.links, self.report, self.rng = links, report, rng
        self.open: Window | None = None
        self.recovering: Window | None = None
        self.windows: list[Window] = []  # every window so far: reads overlapping one may take longer
        self._lock = threading.Lock()  # the timer that ends a window runs beside the requests
        self._timer: threading.Timer | None = None

    @property
    def busy(self) -> bool:
        """A window is open, or its reads have not come back yet: draw no other fault."""
        return self.open is not None or self.recovering is not None

    def start(self, kind: str, prefill_host: Host, decode_host: Host) -> None:
        """Open a window of ``kind`` on the pairing's hosts."""
        target = (prefill_host, decode_host)[int(self.rng.integers(2))]
        duration_s = float(self.rng.uniform(*WINDOW_S))
        if kind == "link_down":
            self.links.link_down(target)
            what = f"{target.name} link down"
        elif kind == "loss":
            probability = float(self.rng.uniform(0.05, 0.3))
            self.links.loss(target, probability)
            what = f"{target.name} loses {probability:.0%}"
        elif kind == "delay":
            delay_s, jitter_s = float(self.rng.uniform(0.02, 0.1)), float(self.rng.uniform(0.0, 0.01))
            self.links.delay(target, delay_s, jitter_s=jitter_s)
            what = f"{target.name} delays {delay_s * 1e3:.0f} ms (+{jitter_s * 1e3:.0f})"
        elif kind == "reorder":
            delay_s, share = float(self.rng.uniform(0.01, 0.03)), float(self.rng.uniform(0.25, 0.5))
            self.links.delay(target, delay_s, reorder=share)
            what = f"{target.name} reorders {share:.0%} (others {delay_s * 1e3:.0f} ms late)"
        elif kind == "partition":
            self.links.partition(prefill_host, decode_host)
            target = None
            what = f"{prefill_host.name} | {decode_host.name} partitioned"
        else:
            raise ValueError(f"not a network fault: {kind}")
        hosts = (prefill_host, decode_host) if target is None else (target,)
        now = time.monotonic()
        with self._lock:
            self.open = Window(kind, hosts, now, now + duration_s)
            self.windows.append(self.open)
        self.report.log(f"  {what} for {duration_s:.1f} s")
        # On time even while a read waits for the link: a read aborted mid-transfer ends when it is back.
        self._timer = threading.Timer(duration_s, self.clear)
        self._timer.start()

    def overlap_s(self, start_s: float, end_s: float) -> float:
        """Seconds of network faults between ``start_s`` and ``end_s`` (monotonic)."""
        with self._lock:
            return sum(max(0.0, min(end_s, w.cleared_s or end_s) - max(start_s, w.start_s)) for w in self.windows)

    def clear(self) -> None:
        """Close the open window now (its time is up, or the pairing ends); reads must then come back."""
        with self._lock:
            window, self.open = self.open, None
            if window is None:
                return
            try:
                for host in window.hosts:
                    self.links.clear(host)
            except Exception as err:  # runs on the timer's thread too: said here, not lost there
                self.report.violate("recovery", f"{window.kind} could not be cleared: {type(err).__name__}: {err}")
            finally:
                window.cleared_s = time.monotonic()
                self.recovering = window
            self.report.log(f"  {window.kind} cleared after {window.cleared_s - window.start_s:.1f} s")

    def read_done(self, ok: bool) -> None:
        """A read ended (``ok``: byte-exact on every rank): detection and recovery figures."""
        with self._lock:
            self._read_done(ok)

    def _read_done(self, ok: bool) -> None:
        now = time.monotonic()
        window = self.open or self.recovering
        if window is not None and not ok and not window.detected:  # (a read aborted mid-transfer fails only
            window.detected = True                                   # once the link is back: see abort_drain_s)
            self.report.figure(f"{window.kind}_detected_s", now - window.start_s)
        window = self.recovering
        if window is None:
            return
        if ok:
            self.report.figure(f"{window.kind}_recovered_s", now - window.cleared_s)
            if not window.detected:
                self.report.count(f"{window.kind}_absorbed")
            self.recovering = None
        elif now - window.cleared_s > RECOVERY_BOUND_S:
            self.report.violate("recovery", f"reads still fail {now - window.cleared_s:.0f} s after {window.kind} "
                                            f"on {', '.join(h.name for h in window.hosts)} was cleared")
            self.recovering = None

    def settle(self) -> None:
        """Before a pairing ends, or the run: close any window (its recovery is then not measured)."""
        if self._timer is not None:
            self._timer.cancel()
        self.clear()
        self.recovering = None
