"""``kvxferd soak --hosts N``: the soak's daemons and engines on network namespaces, as on real hosts.

Host ``h0`` runs every prefill rank's daemon and the prefill engine; each of
``h1`` .. ``h<N-1>`` runs a decode daemon per rank, and the pairings take
turns among them (pairing 1 on h1, pairing 2 on h2, ...). Peer ports run
mutual TLS, UCX runs over TCP on each host's ``eth0``, the chart's
NetworkPolicy is enforced on every host, and the notify bus stays on the
prefill host's loopback (the driver listens from inside that namespace)::

    h0: prefill engine, daemons p0..p3 ──link──► switch ◄──link── h1: decode engine, daemons d0..d3
                                                        ◄──link── h2: (next pairing's decode)
"""

from __future__ import annotations

import os

from kvxferd.rig.soak.daemons import DaemonLife, DaemonSet
from kvxferd.rig.verify.hosts import policy
from kvxferd.rig.verify.hosts.daemons import ChartPorts, NamespaceDaemon, Pki, start_host_daemons, ucx_environment
from kvxferd.rig.verify.hosts.fabric import Fabric, Host
from kvxferd.rig.verify.hosts.linkfaults import LinkFaults


class SoakHosts:
    """The fabric, its policy, its link faults and every host's daemons."""

    def __init__(self, num_hosts: int, max_tp: int, workdir: str, daemon_args: tuple[str, ...]) -> None:
        policy.require()
        self.fabric = Fabric(num_hosts)
        try:
            self.prefill_host, self.decode_hosts = self.fabric.hosts[0], self.fabric.hosts[1:]
            roles = {h.name: ("prefill" if h is self.prefill_host else "decode") for h in self.fabric.hosts}
            policy.enforce(self.fabric, roles, {"prefill": max_tp, "decode": max_tp})
            self.ports = ChartPorts.from_chart()
            self.links = LinkFaults(self.fabric)
            pki = Pki(os.path.join(workdir, "pki"))
            start = dict(workdir=workdir, pki=pki, ports=self.ports, extra_args=daemon_args)
            prefill = start_host_daemons(self.prefill_host, "prefill", max_tp, **start)
            again = NamespaceDaemon.start_again  # a killed daemon, at its addresses and with its flags
            self.daemons = DaemonSet([DaemonLife(d, "prefill", q, again) for q, d in enumerate(prefill)], [])
            for host in self.decode_hosts:
                decode = start_host_daemons(host, "decode", max_tp, **start)
                self.daemons.decode_sets.append([DaemonLife(d, "decode", r, again) for r, d in enumerate(decode)])
        except BaseException:
            self.close()
            raise

    def use_pairing(self, epoch: int) -> Host:
        """Pairing ``epoch`` (from 1) reads on the next decode host; that host."""
        self.daemons.current = (epoch - 1) % len(self.decode_hosts)
        return self.decode_host

    @property
    def decode_host(self) -> Host:
        return self.decode_hosts[self.daemons.current]

    def engine_options(self, role: str) -> dict:
        """Where an engine process of ``role`` runs now, with UCX set for that host."""
        host = self.prefill_host if role == "prefill" else self.decode_host
        return {"netns": host.netns, "environ": ucx_environment(host, self.ports)}

    def close(self) -> None:
        """Faults cleared, daemons stopped, namespaces removed."""
        try:
            if hasattr(self, "links"):
                self.links.close()
            if hasattr(self, "daemons"):
                self.daemons.close()
        finally:
            self.fabric.close()
