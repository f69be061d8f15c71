"""``kvxferd demo --hosts N``: the demo across network namespaces, as across real hosts.

Host ``h0`` runs the prefill engine and its daemons; ``h1`` .. ``h<N-1>``
each run a decode engine's daemons, and the models take turns among them::

    h0 198.18.0.1                      h1 198.18.0.2          h2 198.18.0.3
    prefill engine + TP daemons ──►    decode daemons         decode daemons
    (peer ports: mutual TLS;           (gqa, swa, ...)        (fp8, mla, ...)
     UCX over TCP on eth0)

Every host enforces the chart's NetworkPolicy as packet-filter rules
(:mod:`kvxferd.rig.verify.hosts.policy`); the raw NIXL baseline runs on the
decode host too, across the same link.
"""

from __future__ import annotations

from kvxferd.rig.verify.hosts.daemons import ChartPorts, NamespaceDaemon, Pki, start_host_daemons, ucx_environment
from kvxferd.rig.verify.hosts.fabric import Fabric
from kvxferd.rig.verify.hosts import policy


class DemoHosts:
    """The fabric, its policy and every host's daemons; :meth:`close` removes all of it."""

    def __init__(self, num_hosts: int, prefill_tp: int, decode_tp: int, workdir: str,
                 daemon_args: tuple[str, ...]) -> None:
        policy.require()
        self.fabric = Fabric(num_hosts)
        try:
            hosts = self.fabric.hosts
            roles = {h.name: ("prefill" if i == 0 else "decode") for i, h in enumerate(hosts)}
            self.admitted = policy.enforce(self.fabric, roles, {"prefill": prefill_tp, "decode": decode_tp})
            self.ports = ChartPorts.from_chart()
            self.pki = Pki(f"{workdir}/pki")
            start = dict(workdir=workdir, pki=self.pki, ports=self.ports, extra_args=daemon_args)
            self.prefill_host, self.decode_hosts = hosts[0], hosts[1:]
            self.prefill: list[NamespaceDaemon] = start_host_daemons(hosts[0], "prefill", prefill_tp, **start)
            self.decode = {h.name: start_host_daemons(h, "decode", decode_tp, **start) for h in self.decode_hosts}
            self.raw_tls_files = self.pki.client_files("raw-baseline")
        except BaseException:
            self.close()
            raise

    @property
    def daemons(self) -> list[NamespaceDaemon]:
        return self.prefill + [d for ranks in self.decode.values() for d in ranks]

    def turn(self, index: int) -> tuple[dict, dict, dict]:
        """Model ``index``'s ``(daemons by role, prefill engine options, decode engine options)``."""
        decode_host = self.decode_hosts[index % len(self.decode_hosts)]
        daemons = {"prefill": self.prefill, "decode": self.decode[decode_host.name]}
        prefill_options = dict(netns=self.prefill_host.netns, environ=ucx_environment(self.prefill_host, self.ports))
        decode_options = dict(netns=decode_host.netns, environ=ucx_environment(decode_host, self.ports),
                              tls_files=self.raw_tls_files)
        return daemons, prefill_options, decode_options

    def describe(self) -> dict:
        """Each host's role, address and link bytes; packets each host's policy refused."""
        return {h.name: {"role": "prefill" if h is self.prefill_host else "decode", "address": h.address,
                         **self.fabric.link_bytes(h), "policy_refused_packets": policy.refused_packets(self.fabric, h)}
                for h in self.fabric.hosts}

    def close(self) -> None:
        try:
            for daemon in getattr(self, "prefill", []) + [d for r in getattr(self, "decode", {}).values() for d in r]:
                daemon.terminate()
        finally:
            if hasattr(self, "fabric"):
                self.fabric.close()
