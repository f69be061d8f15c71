"""``kvxferd bench daemon --hosts``: the daemon pair on two network namespaces, raw NIXL across the same link.

The prefill daemon runs on host ``h0``, the decode daemon on ``h1``, as the
rig runs them across hosts (mutual TLS, the chart's NetworkPolicy, UCX over
TCP on ``eth0``). The benchmark itself (the engines' clients and the raw
NIXL baseline) moves to ``h1``, beside the decode daemon, so its raw reads
cross the same link the daemon's do; it hears the prefill daemon's notify
bus (on ``h0``'s loopback) through a ZMQ I/O thread started inside ``h0``::

    h0: prefill daemon ◄──── link ────► h1: decode daemon
                                            this process: engine clients, raw NIXL agent
"""

from __future__ import annotations

import os

import grpc
import zmq

from kvxferd.rig.verify.hosts import policy
from kvxferd.rig.verify.hosts.daemons import ChartPorts, NamespaceDaemon, Pki, host_daemon, ucx_environment
from kvxferd.rig.verify.hosts.fabric import Fabric
from kvxferd.rig.verify.hosts.nsenter import setns_fd, setns_thread, zmq_context_in


class HostsPlacement:
    """Where ``bench daemon``'s clusters start their daemons (``start_many``), and the raw baseline's TLS."""

    def __init__(self, workdir: str) -> None:
        policy.require()
        self._root_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._environ = dict(os.environ)
        try:
            self.fabric = Fabric(2)
            self.prefill_host, self.decode_host = self.fabric.hosts
            policy.enforce(self.fabric, {"h0": "prefill", "h1": "decode"}, {"prefill": 1, "decode": 1})
            self.ports = ChartPorts.from_chart()
            self.pki = Pki(os.path.join(workdir, "pki"))
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
            if hasattr(self, "fabric"):
                self.fabric.close()
