"""Prometheus metrics of one daemon (its own registry, bounded labels only).

Labels never carry engine, request or peer ids: a failure ``kind`` is one
of a fixed set, an RPC ``method`` is one of the service's methods.

Every labelled series is created at zero for each label value the code can
pass, so a dashboard query or an alert expression has series on an idle
daemon, and ``increase()`` sees the first event (a series born at 1 shows
no increase). The registry exports no ``_created`` series; it does export
``kvxferd_build_info`` and the standard ``process_*`` and ``python_*``
series of prometheus_client's collectors.
"""

from __future__ import annotations

import copy
import importlib.metadata
import platform
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.metrics_core import Metric

from kvxferd.plan.leases import HoldEndKind
from kvxferd.proto.v1 import engine_service_pb2, peer_service_pb2
from kvxferd.service.base.metricsserver import MetricsServer
from kvxferd.xfer.holder import NoticeEvent
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.ucxpaths import MEMORY_PAIRS, PATHS

FAILURE_KINDS = tuple(kind.value for kind in ReadFailure if kind is not ReadFailure.NONE)
READS_SOCKET_METHOD = "ReadsSocket"  # the reads socket (net/readsock.py) in kvxferd_rpc_errors
OUTCOMES = ("ok", "failed")  # of a read (reads/path.py) and of a handshake (peers/links.py)
PUSH_OUTCOMES = ("ok", "failed", "refused")  # kvxferd_push_writes: refused expectations wrote nothing
EVENT_KINDS = tuple(kind.value for kind in HoldEndKind)
DROPPED_NOTICES = tuple(event.value for event in NoticeEvent if event.dropped)
# FdInbox's refusals (engines/fdpass.py names them inline): peer uid or gid not allowed, not one
# printable token, max_fd_tokens or a token in use, max_fds_waiting, a socket error, a bug, a share token it does not know.
FD_REFUSALS = ("uid", "malformed", "tokens", "fds", "io", "error", "share")
BUS_REFUSALS = ("prefix", "flood", "limit")  # NotifyBus's refusals (net/bus.py, net/busguard.py)
WORKER_REPLACE_REASONS = ("ca_changed", "certificate_expires", "introduction_ended")  # service/workers/trust.py
# kvxferd_rpc_errors' methods: those of both gRPC services and the engine's read socket (READS_SOCKET_METHOD; its Hold frames count as "Hold").
RPC_METHODS = tuple(method.name for module, service in ((engine_service_pb2, "EngineService"),
                                                         (peer_service_pb2, "PeerService"))
                    for method in module.DESCRIPTOR.services_by_name[service].methods) + (READS_SOCKET_METHOD,)
# The one code whose series exists for every method from start-up: INTERNAL (a bug, an error with
# no type) is the answer every method can give and the one an alert must see the first time. Every
# code for every method would be over 150 zero series, most for answers a method never gives (and
# a panel of 150 flat lines); the other codes' series appear at their first error.
RPC_INITIAL_CODE = grpc.StatusCode.INTERNAL.name
_LATENCY_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_NO_CREATED = ("counter", "histogram", "summary")


class _Registry(CollectorRegistry):
    """A registry whose counters and histograms export no ``_created`` series.

    prometheus_client adds one per series (a gauge to Prometheus, doubling the series count and
    meaning nothing to a dashboard). Its switch for that, ``disable_created_metrics()``, is
    process-wide: it would also change the vLLM connector's metrics (integrations/vllm/stats.py)
    where they share a process with a :class:`Metrics`. Filtering here touches this registry only.
    """

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            if metric.type in _NO_CREATED and any(s.name.endswith("_created") for s in metric.samples):
                metric = copy.copy(metric)
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def build_labels() -> dict[str, str]:
    """``kvxferd_build_info``'s labels: kvxferd's, Python's and NIXL's versions (installed metadata,
    no import; ``none`` where a package is not installed)."""
    return {"version": _package_version("kvxferd"), "python": platform.python_version(),
            "nixl": _package_version("nixl")}


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class Metrics:
    """Every metric the daemon exports."""

    def __init__(self) -> None:
        self.registry = _Registry()
        r = self.registry
        build = build_labels()
        self.build_info = Gauge("kvxferd_build_info", "always 1; the labels say which kvxferd, Python and NIXL "
                                "this daemon runs", list(build), registry=r)
        self.build_info.labels(**build).set(1)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):  # process_*, python_*
            collector(registry=r)
        self.read_duration = Histogram("kvxferd_read_duration_seconds", "submit to completion of a read (incl. board checks)",
                                       ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.read_post = Histogram("kvxferd_read_post_seconds", "submit to every rank posted",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.read_bytes = Counter("kvxferd_read_bytes", "bytes read into local engines", registry=r)
        self.read_descriptors = Histogram("kvxferd_read_descriptors", "NIXL descriptors posted per read",
                                          buckets=_DESCRIPTOR_BUCKETS, registry=r)
        self.read_failures = Counter("kvxferd_read_failures", "failed reads by kind", ["kind"], registry=r)
        self.digest_checked_bytes = Counter("kvxferd_digest_checked_bytes", "bytes of reads checked against their "
                                            "holds' digests before they completed (issue #59), corrupt ones too",
                                            registry=r)
        self.same_host_copies = Counter("kvxferd_same_host_copies", "remote ranks' parts of reads copied from a "
                                        "same-host holder's shared memory instead of read over NIXL", registry=r)
        self.push_writes = Counter("kvxferd_push_writes", "push (issue #57), prefill side: writes into a decode "
                                   "rank's expected blocks, by outcome", ["outcome"], registry=r)
        self.push_duration = Histogram("kvxferd_push_duration_seconds", "push (issue #57), decode side: an "
                                       "expectation's submit to its completion (every writer wrote, or it failed)",
                                       ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.push_bytes = Counter("kvxferd_push_bytes", "push, prefill side: bytes written into decode ranks' blocks",
                                  registry=r)
        self.push_same_host_copies = Counter("kvxferd_push_same_host_copies", "push, prefill side: writes (or "
                                             "stages) copied into a same-host decode engine's shared memory instead "
                                             "of written over NIXL (same_host_writes)", registry=r)
        self.push_stages = Counter("kvxferd_push_stages", "push written layer by layer, prefill side: stages posted "
                                   "(the layers found final since the last stage, each)", registry=r)
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
        self.tls_files_unusable = Gauge("kvxferd_tls_files_unusable", "1 while the TLS files on disk differ from "
                                        "those in use and cannot be loaded (unreadable, half-written, a key that "
                                        "does not match, or refused): the previous ones stay in use", registry=r)
        self.fd_socket_refused = Counter("kvxferd_fd_socket_refused", "fd-socket connections refused", ["reason"],
                                         registry=r)
        self.bus_subscriptions_refused = Counter("kvxferd_bus_subscriptions_refused", "notify-bus subscriptions "
                                                 "not applied: not one whole engine topic (prefix), a subscriber "
                                                 "connection closed for what its source sent (flood: once per "
                                                 "connection), or too many at once (limit: the bus dropped every "
                                                 "subscriber and started over)", ["reason"], registry=r)
        self.peer_connections_closed = Counter("kvxferd_peer_connections_closed", "peer-port connections closed "
                                               "past max_peer_connections_per_source (the newest of a source)",
                                               registry=r)
        self.rpc_errors = Counter("kvxferd_rpc_errors", "RPCs answered with an error status", ["method", "code"],
                                  registry=r)
        self.loop_stalls = Counter("kvxferd_loop_stalls", "times the event loop woke over LOOP_STALL_S late "
                                   "(stopped, starved, or a blocking call on it)", registry=r)
        self.worker_deaths = Counter("kvxferd_dataplane_worker_deaths", "data-plane workers that ended other than "
                                     "at their engine's deregistration (dataplane_workers; each is started again)",
                                     registry=r)
        self.worker_replacements = Counter("kvxferd_dataplane_worker_replacements", "data-plane workers replaced "
                                           "because trust in the metadata peers were handed ended (reason: "
                                           "ca_changed, certificate_expires, introduction_ended)", ["reason"],
                                           registry=r)
        self.sessions_handed = Counter("kvxferd_reader_worker_sessions", "engine reads sessions handed to the "
                                       "engine's reader worker (dataplane_reader_workers, reader_worker_sessions): "
                                       "their reads never pass through the daemon", registry=r)
        self.workers_given_up = Gauge("kvxferd_dataplane_workers_given_up", "engine ranks whose data-plane worker "
                                      "cannot start again (it could not map the engine's memory, or broke "
                                      "the protocol before it was up; peers are refused until the engine "
                                      "registers again)", registry=r)
        self.transport_paths = Gauge("kvxferd_transport_paths", "UCX endpoint configurations of this daemon and its "
                                     "workers whose bulk READs of a memory pair (local<-remote) take a path "
                                     "(emulated: no direct lane, UCX moves the bytes with messages)",
                                     ["memory", "path"], registry=r)
        for memory in MEMORY_PAIRS:
            for path in PATHS:
                self.transport_paths.labels(memory, path)
        self.vram_regions = Gauge("kvxferd_vram_regions", "registered GPU cache regions by what can serve them: "
                                  "rdma_capable (VMM, gpuDirectRDMACapable), not_rdma_capable (VMM without it), "
                                  "legacy_ipc (cudaMalloc memory by IPC handle); the last two are read from other "
                                  "hosts by UCX's emulation over TCP", ["kind"], registry=r)
        self.holds_pending = Gauge("kvxferd_holds_pending", "requests held for reading", registry=r)
        self.push_expectations = Gauge("kvxferd_push_expectations", "push, prefill side: decode ranks' "
                                       "expectations kept, waiting for their hold or being written", registry=r)
        self.reads_in_flight = Gauge("kvxferd_reads_in_flight", "reads submitted and not completed", registry=r)
        self.engines = Gauge("kvxferd_engines_registered", "engine ranks registered", registry=r)
        self.wake_sets = Gauge("kvxferd_wake_sets", "socket sets of UCX's tcp transport the data-plane thread "
                               "sleeps on (a peer's request wakes it); 0 with engines registered: their agents are "
                               "served on its timer alone (docs/costs.md)", registry=r)
        self.wake_set_mutes = Gauge("kvxferd_wake_set_mutes", "times a socket set was left out for firing with "
                                    "nothing to do (a peer that stopped mid-connection), since start", registry=r)
        self._create_series()

    def _create_series(self) -> None:
        """Every labelled series at zero for each label value the code passes (see the module's doc)."""
        for metric, values in ((self.read_duration, OUTCOMES), (self.handshake_duration, OUTCOMES),
                               (self.read_failures, FAILURE_KINDS), (self.events, EVENT_KINDS),
                               (self.notices_dropped, DROPPED_NOTICES), (self.fd_socket_refused, FD_REFUSALS),
                               (self.bus_subscriptions_refused, BUS_REFUSALS),
                               (self.worker_replacements, WORKER_REPLACE_REASONS),
                               (self.push_duration, OUTCOMES), (self.push_writes, PUSH_OUTCOMES)):
            for value in values:
                metric.labels(value)
        for method in RPC_METHODS:
            self.rpc_errors.labels(method, RPC_INITIAL_CODE)

    def bind_gauges(self, holds: Callable[[], int], reads: Callable[[], int], engines: Callable[[], int],
                    expectations: Callable[[], int]) -> None:
        """Gauges read at scrape time from the daemon's state."""
        self.holds_pending.set_function(holds)
        self.push_expectations.set_function(expectations)
        self.reads_in_flight.set_function(reads)
        self.engines.set_function(engines)

    def serve(self, host: str, port: int) -> tuple[MetricsServer, int]:
        """Start the HTTP endpoint (one thread, bounded connections); returns (server, bound port)."""
        server = MetricsServer(self.registry, host, port)
        return server, server.port
