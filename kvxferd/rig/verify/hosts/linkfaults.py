"""Real network faults on the fabric's links: a pulled cable, loss, delay, reordering, a partition.

Everything acts on packets, never on processes: the daemons see what they
would see on a real network. Rules go into each host's ``KVX-FAULT`` chain
(policy.py), which INPUT and OUTPUT pass through before anything else, so
clearing a fault is flushing that chain::

    link_down   the host's switch port down: eth0 loses carrier
    loss        iptables statistic: each packet in and out of eth0 dropped with probability p
    delay       packets arriving on eth0 queued to NFQUEUE; linkdelay.py lets each in D (+ jitter) later
    reorder     as delay, but a share of packets go at once, overtaking those held
    partition   two hosts drop each other's packets (both directions); others still reach both

This kernel has no netem qdisc, hence user-space delay (linkdelay.py).
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys

from kvxferd.rig.verify.hosts.fabric import IPTABLES, Fabric, Host

FAULT_CHAIN = "KVX-FAULT"
DELAY_QUEUE = 7  # the NFQUEUE number linkdelay.py binds, in each host's own namespace
READY_TIMEOUT_S = 10.0


class LinkFaults:
    """Faults on ``fabric``'s hosts; :meth:`clear` undoes one host's, :meth:`close` everyone's."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self._delayers: dict[str, subprocess.Popen] = {}
        self._down: set[str] = set()
        for host in fabric.hosts:  # first in INPUT and OUTPUT, before any policy: a fault acts on every packet
            self._iptables(host, "-N", FAULT_CHAIN)
            self._iptables(host, "-I", "INPUT", "1", "-j", FAULT_CHAIN)
            self._iptables(host, "-I", "OUTPUT", "1", "-j", FAULT_CHAIN)

    def _iptables(self, host: Host, *argv: str) -> None:
        self.fabric.run(host, IPTABLES, "-w", *argv)

    def link_down(self, host: Host) -> None:
        """Pull ``host``'s cable."""
        self.fabric.set_link(host, up=False)
        self._down.add(host.name)

    def loss(self, host: Host, probability: float) -> None:
        """Drop each packet into and out of ``host``'s eth0 with ``probability``."""
        if not 0.0 < probability < 1.0:
            raise ValueError(f"loss probability must be in (0, 1), got {probability}")
        for direction in ("-i", "-o"):
            self._iptables(host, "-A", FAULT_CHAIN, direction, host.interface, "-m", "statistic", "--mode", "random",
                           "--probability", f"{probability:.4f}", "-j", "DROP")

    def delay(self, host: Host, delay_s: float, *, jitter_s: float = 0.0, reorder: float = 0.0) -> None:
        """Hold each packet arriving on ``host``'s eth0 ``delay_s`` (+ up to ``jitter_s``); ``reorder``: the
        share let in at once instead, overtaking the held ones.

        Arriving, not leaving: a packet held on its way out still counts against its TCP socket's
        small-queue limit (netem releases that; NFQUEUE cannot), so TCP sent about two segments per
        round trip: 0.06 MB/s at 50 ms. Held on the way in, round trips see the same delay."""
        if host.name in self._delayers:
            raise RuntimeError(f"{host.name} already has a delay")
        delayer = subprocess.Popen(
            [sys.executable, "-m", "kvxferd.rig.verify.hosts.linkdelay", "--netns", host.netns, "--queue",
             str(DELAY_QUEUE), "--delay-ms", f"{delay_s * 1e3:.3f}", "--jitter-ms", f"{jitter_s * 1e3:.3f}",
             "--reorder", f"{reorder:.4f}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._delayers[host.name] = delayer
        line = _read_line(delayer, READY_TIMEOUT_S)
        if line.strip() != "linkdelay ready":
            self._stop_delayer(host)
            raise RuntimeError(f"linkdelay on {host.name} did not start (exit {delayer.poll()}, said {line!r})")
        # --queue-bypass: were the delayer gone, packets would pass rather than vanish.
        self._iptables(host, "-A", FAULT_CHAIN, "-i", host.interface, "-j", "NFQUEUE", "--queue-num",
                       str(DELAY_QUEUE), "--queue-bypass")

    def partition(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` cannot reach each other; both still reach every other host."""
        for host, other in ((a, b), (b, a)):
            self._iptables(host, "-A", FAULT_CHAIN, "-s", other.address, "-j", "DROP")
            self._iptables(host, "-A", FAULT_CHAIN, "-d", other.address, "-j", "DROP")

    def clear(self, host: Host) -> None:
        """Undo every fault on ``host``: rules flushed, its delayer stopped (held packets go), its link up."""
        self._iptables(host, "-F", FAULT_CHAIN)
        self._stop_delayer(host)
        if host.name in self._down:
            self.fabric.set_link(host, up=True)
            self._down.discard(host.name)

    def _stop_delayer(self, host: Host) -> None:
        delayer = self._delayers.pop(host.name, None)
        if delayer is None:
            return
        delayer.terminate()  # it lets every packet it holds go before it exits
        try:
            delayer.wait(5)
        except subprocess.TimeoutExpired:
            delayer.kill()
            delayer.wait()

    def close(self) -> None:
        """Clear every host (the fabric may already be gone: then only the delayers are stopped)."""
        for host in self.fabric.hosts:
            with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                self.clear(host)
        for name in list(self._delayers):
            self._stop_delayer(self.fabric.host(name))


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The first line ``process`` prints within ``timeout_s`` ("" if none)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    return process.stdout.readline() if ready else ""
