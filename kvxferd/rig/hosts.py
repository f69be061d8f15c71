"""The rig on network namespaces, as on real hosts: the demo's, the soak's and ``bench daemon``'s placements.

Every placement starts from one fabric (:class:`ChartHosts`): host ``h0`` is
the prefill host, ``h1`` .. ``h<N-1>`` decode hosts; every host enforces the
chart's NetworkPolicy as packet-filter rules (:mod:`kvxferd.rig.verify.hosts.policy`),
peer ports run mutual TLS from one PKI, and UCX runs over TCP on each host's
``eth0`` with the chart's ports::

    h0 198.18.0.1                         h1 198.18.0.2            h2 198.18.0.3
    prefill engine + daemons ──link──►   decode daemons            decode daemons
                                          (one model / pairing)    (the next one)

* :class:`DemoHosts` (``kvxferd demo --hosts N``): the models take turns among
  the decode hosts; the raw NIXL baseline runs on the decode host, across the
  same link.
* :class:`SoakHosts` (``kvxferd soak --hosts N``): the pairings take turns;
  link faults; daemons killed and started again at their addresses; the notify
  bus stays on the prefill host's loopback (the driver listens from inside
  that namespace).
* :class:`BenchHosts` (``kvxferd bench daemon --hosts``): one pair; this
  process (the engines' clients and the raw NIXL baseline) moves into ``h1``
  beside the decode daemon, so its raw reads cross the link the daemon's do,
  and hears the prefill daemon's bus through a ZMQ I/O thread started in ``h0``.
"""

from __future__ import annotations

import os

import grpc
import zmq

from kvxferd.rig.daemons import (ChartPorts, DaemonLife, DaemonSet, NamespaceDaemon, Pki, host_daemon,
                                 start_host_daemons, ucx_environment)
from kvxferd.rig.verify.hosts import policy
from kvxferd.rig.verify.hosts.fabric import Fabric, Host
from kvxferd.rig.verify.hosts.linkfaults import LinkFaults
from kvxferd.rig.verify.hosts.nsenter import setns_fd, setns_thread, zmq_context_in


class ChartHosts:
    """The fabric, its policy, the chart's ports and a PKI; :meth:`close` removes the namespaces."""

    def __init__(self, num_hosts: int, tp_by_role: dict[str, int], workdir: str) -> None:
        policy.require()
        self.fabric = Fabric(num_hosts)
        try:
            self.prefill_host, self.decode_hosts = self.fabric.hosts[0], self.fabric.hosts[1:]
            roles = {h.name: ("prefill" if h is self.prefill_host else "decode") for h in self.fabric.hosts}
            self.admitted = policy.enforce(self.fabric, roles, tp_by_role)
            self.ports = ChartPorts.from_chart()
            self.pki = Pki(os.path.join(workdir, "pki"))
        except BaseException:
            self.fabric.close()
            raise

    def engine_options(self, host: Host) -> dict:
        """Where an engine process on ``host`` runs, with UCX set for that host."""
        return {"netns": host.netns, "environ": ucx_environment(host, self.ports)}

    def describe(self) -> dict:
        """Each host's role, address and link bytes; packets each host's policy refused."""
        return {h.name: {"role": "prefill" if h is self.prefill_host else "decode", "address": h.address,
                         **self.fabric.link_bytes(h), "policy_refused_packets": policy.refused_packets(self.fabric, h)}
                for h in self.fabric.hosts}

    def close(self) -> None:
        self.fabric.close()


class DemoHosts(ChartHosts):
    """Every host's daemons for the demo, started once."""

    def __init__(self, num_hosts: int, prefill_tp: int, decode_tp: int, workdir: str,
                 daemon_args: tuple[str, ...]) -> None:
        super().__init__(num_hosts, {"prefill": prefill_tp, "decode": decode_tp}, workdir)
        self.prefill: list[NamespaceDaemon] = []
        self.decode: dict[str, list[NamespaceDaemon]] = {}
        try:
            start = dict(workdir=workdir, pki=self.pki, ports=self.ports, extra_args=daemon_args)
            self.prefill = start_host_daemons(self.prefill_host, "prefill", prefill_tp, **start)
            for host in self.decode_hosts:
                self.decode[host.name] = start_host_daemons(host, "decode", decode_tp, **start)
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
        return (daemons, self.engine_options(self.prefill_host),
                {**self.engine_options(decode_host), "tls_files": self.raw_tls_files})

    def close(self) -> None:
        try:
            for daemon in self.daemons:
                daemon.terminate()
        finally:
            super().close()


class SoakHosts(ChartHosts):
    """Every host's daemons as a :class:`DaemonSet` (killed, frozen, started again), and the link faults."""

    def __init__(self, num_hosts: int, max_tp: int, workdir: str, daemon_args: tuple[str, ...],
                 module: str = "kvxferd") -> None:
        super().__init__(num_hosts, {"prefill": max_tp, "decode": max_tp}, workdir)
        self.links: LinkFaults | None = None
        self.daemons: DaemonSet | None = None
        try:
            self.links = LinkFaults(self.fabric)
            start = dict(workdir=workdir, pki=self.pki, ports=self.ports, extra_args=daemon_args, module=module)
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

    def role_options(self, role: str) -> dict:
        """Where an engine process of ``role`` runs now."""
        return self.engine_options(self.prefill_host if role == "prefill" else self.decode_host)

    def close(self) -> None:
        """Faults cleared, daemons stopped, namespaces removed."""
        try:
            if self.links is not None:
                self.links.close()
            if self.daemons is not None:
                self.daemons.close()
        finally:
            super().close()


class BenchHosts(ChartHosts):
    """Where ``bench daemon``'s clusters start their daemons (``start_many``), and the raw baseline's TLS."""

    def __init__(self, workdir: str) -> None:
        super().__init__(2, {"prefill": 1, "decode": 1}, workdir)
        self.decode_host = self.decode_hosts[0]
        self._root_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._environ = dict(os.environ)
        try:
            ca, cert, key = (open(path, "rb").read() for path in self.pki.client_files("bench-raw"))
            self.credentials = grpc.ssl_channel_credentials(ca, key, cert)
            self.daemon_args: tuple[str, ...] = ()
            # NotifySubscriber uses the process's global context: its I/O thread must start in h0, or the
            # subscriptions would dial this process's own loopback and wait forever.
            if getattr(zmq.Context, "_instance", None) is not None:
                raise RuntimeError("bench daemon --hosts must start before anything in this process used ZMQ")
            zmq_context_in(self.prefill_host.netns, zmq.Context.instance)
            os.environ.update(ucx_environment(self.decode_host, self.ports))  # the raw agent's UCX
            setns_thread(self.decode_host.netns)  # threads started from here on (gRPC, UCX) are in h1 too
        except BaseException:
            self.close()
            raise

    def start_many(self, daemon_ids, *, socket_dir: str, extra_args=(), args_of=None) -> list[NamespaceDaemon]:
        """Start ``<name>-p<q>`` on h0 and ``<name>-d<r>`` on h1, rank ``q``/``r`` of the chart's ports."""
        daemons = []
        for daemon_id in daemon_ids:
            role, rank = daemon_id.rsplit("-", 1)[1][0], int(daemon_id.rsplit("-", 1)[1][1:])
            daemons.append(host_daemon(daemon_id, self.prefill_host if role == "p" else self.decode_host, rank,
                                       workdir=socket_dir, pki=self.pki, ports=self.ports, socket_dir=socket_dir,
                                       extra_args=(*extra_args, *(args_of(daemon_id) if args_of else ()))))
        return NamespaceDaemon.wait_all(daemons)

    def close(self) -> None:
        """Back to this machine's namespace; the fabric removed."""
        try:
            setns_fd(self._root_netns, "this machine's namespace")
            os.close(self._root_netns)
            os.environ.clear()
            os.environ.update(self._environ)
        finally:
            super().close()
