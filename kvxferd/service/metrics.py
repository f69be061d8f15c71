"""Prometheus metrics of one daemon (its own registry, bounded labels only).

Labels never carry engine, request or peer ids: a failure ``kind`` is one
of a fixed set, an RPC ``method`` is one of the service's methods.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvxferd.service.net.metricsserver import MetricsServer
from kvxferd.xfer.records import ReadFailure

FAILURE_KINDS = tuple(kind.value for kind in ReadFailure if kind is not ReadFailure.NONE)
_LATENCY_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Metrics:
    """Every metric the daemon exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.read_duration = Histogram("kvxferd_read_duration_seconds", "submit to completion of a read (incl. board checks)",
                                       ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.read_post = Histogram("kvxferd_read_post_seconds", "submit to every rank posted",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.read_bytes = Counter("kvxferd_read_bytes", "bytes read into local engines", registry=r)
        self.read_descriptors = Histogram("kvxferd_read_descriptors", "NIXL descriptors posted per read",
                                          buckets=_DESCRIPTOR_BUCKETS, registry=r)
        self.read_failures = Counter("kvxferd_read_failures", "failed reads by kind", ["kind"], registry=r)
        self.same_host_copies = Counter("kvxferd_same_host_copies", "remote ranks' parts of reads copied from a "
                                        "same-host holder's shared memory instead of read over NIXL", registry=r)
        for kind in FAILURE_KINDS:
            self.read_failures.labels(kind)
        self.handshake_duration = Histogram("kvxferd_handshake_duration_seconds", "handshakes with remote engines",
                                            ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.leases_expired = Counter("kvxferd_leases_expired", "holds whose lease ran out unread", registry=r)
        self.stale_reads = Counter("kvxferd_stale_reads", "reads whose hold had left the holder's board when they were "
                                   "checked (blocks invalid)", registry=r)
        self.unsettled_reads = Counter("kvxferd_unsettled_reads", "failed reads whose aborted NIXL transfer still "
                                       "ran after abort_drain_s: their blocks may still be written (a link down "
                                       "for longer than that)", registry=r)
        self.late_notices = Counter("kvxferd_late_notices", "readers' notices for holds that had ended already "
                                    "(lease, release): counted for nothing", registry=r)
        self.waited_notices = Counter("kvxferd_waited_notices", "readers' notices saying their READs waited for "
                                      "this daemon's progress (UCX over TCP, RDMA): each keeps the holder polling "
                                      "every poll_interval_s for 10 s", registry=r)
        self.events = Counter("kvxferd_notify_events", "notify-bus events published", ["kind"], registry=r)
        self.notices_dropped = Counter("kvxferd_notices_dropped", "read notices dropped: from a NIXL agent not "
                                       "introduced for that reader (foreign: forged or stale), not a valid notice "
                                       "(malformed), or without the hold's capability (unsealed)", ["reason"], registry=r)
        self.insecure_listeners = Gauge("kvxferd_insecure_listeners", "listeners reachable from other hosts without "
                                        "authentication (only with --insecure)", registry=r)
        self.tls_reloads = Counter("kvxferd_tls_reloads", "times changed TLS files were loaded", registry=r)
        self.tls_refused = Counter("kvxferd_tls_refused", "times a changed certificate was refused (expired, not "
                                   "yet valid, or off its identity): the previous one stays in use", registry=r)
        self.fd_socket_refused = Counter("kvxferd_fd_socket_refused", "fd-socket connections refused", ["reason"],
                                         registry=r)
        self.bus_subscriptions_refused = Counter("kvxferd_bus_subscriptions_refused", "notify-bus subscriptions "
                                                 "not applied: not one whole engine topic (prefix), or past "
                                                 "max_bus_subscriptions (limit: the bus dropped every subscriber "
                                                 "and started over)", ["reason"], registry=r)
        for reason in ("prefix", "limit"):
            self.bus_subscriptions_refused.labels(reason)
        self.rpc_errors = Counter("kvxferd_rpc_errors", "RPCs answered with an error status", ["method", "code"],
                                  registry=r)
        self.loop_stalls = Counter("kvxferd_loop_stalls", "times the event loop woke over LOOP_STALL_S late "
                                   "(stopped, starved, or a blocking call on it)", registry=r)
        self.holds_pending = Gauge("kvxferd_holds_pending", "requests held for reading", registry=r)
        self.reads_in_flight = Gauge("kvxferd_reads_in_flight", "reads submitted and not completed", registry=r)
        self.engines = Gauge("kvxferd_engines_registered", "engine ranks registered", registry=r)

    def bind_gauges(self, holds: Callable[[], int], reads: Callable[[], int], engines: Callable[[], int]) -> None:
        """Gauges read at scrape time from the daemon's state."""
        self.holds_pending.set_function(holds)
        self.reads_in_flight.set_function(reads)
        self.engines.set_function(engines)

    def serve(self, host: str, port: int) -> tuple[MetricsServer, int]:
        """Start the HTTP endpoint (one thread, bounded connections); returns (server, bound port)."""
        server = MetricsServer(self.registry, host, port)
        return server, server.port
