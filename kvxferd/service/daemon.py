"""``kvxferd serve``: one daemon, its servers and its life cycle.

::

    check:  listeners reachable from other hosts must authenticate (else exit 2,
            unless --insecure); UCX_NET_DEVICES from the advertised address
            (and UCX_TCP_PORT_RANGE from ucx_tcp_port_range)
    start:  data-plane thread ─► notify bus (ZMQ XPUB[, CURVE]) ─► metrics (HTTP)
            ─► engine service (UNIX socket 0600 [+ TCP with TLS and a token])
               + peer service (TCP, mutual TLS when configured),
               both with grpc.health.v1 (and reflection unless TLS)
            ─► prints one "kvxferd ready: ..." line with every address
    run:    maintenance every tick: heartbeats, lease expiry; lease renewal
            for reads that wait; peer probes for restarted remotes
    SIGTERM: NOT_SERVING, refuse new reads/holds ─► drain in-flight reads
            (drain_timeout_s) ─► deregister every engine (fails the rest)
            ─► stop servers and threads

Exit codes: 0 after a clean shutdown, 2 for bad configuration, 3 when the
daemon could not start (an address in use, no NIXL).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxferd.cuda.vmm import MEMORY_KINDS
from kvxferd.errors import InvalidArgumentError, KvxferError, PermissionDeniedError
from kvxferd.plan.leases import EXPIRED, HoldEnd
from kvxferd.proto.v1 import engine_service_pb2, peer_service_pb2
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.service.net.callcap import CallCap, http2_stream_limit
from kvxferd.service.net.bus import NotifyBus
from kvxferd.service.base.config import DaemonConfig
from kvxferd.service.dataplane.thread import DataPlane
from kvxferd.service.engines.registry import Registry
from kvxferd.service.engines.served import WorkerOptions
from kvxferd.service.net.exposure import insecure_listeners, refusal, ucx_environment
from kvxferd.service.net.peerport import ConnectionCap, peer_server_options
from kvxferd.service.engines.fdpass import FdInbox
from kvxferd.wire.names import fd_socket_path
from kvxferd.service.net.listeners import StartupError, bind, bracket_host, claim_unix_socket, engine_tls, read_token
from kvxferd.service.base.localsock import claim_runtime_dir, group_id, restrict_socket, socket_umask
from kvxferd.service.base.transports import TransportPaths, rdma_refusal
from kvxferd.service.base.metrics import Metrics
from kvxferd.service.base.spans import DaemonSpans
from kvxferd.service.peers.links import Peers, RemoteLink
from kvxferd.service.engines.read import Read
from kvxferd.service.reads.path import ReadPath
from kvxferd.service.reads.writer import WritePath
from kvxferd.service.net.readsock import ReadSocketServer
from kvxferd.service.net.servicers import EngineServicer, PeerServicer
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.service.peers.proof import check_own_chain
from kvxferd.service.peers.tls import TlsFiles
from kvxferd.service.workers.trust import CA_CHANGED, CaWatch
from kvxferd.service.net.sessions import WorkerSessions
from kvxferd.wire.peerauth import load_or_create_peer_secret
from kvxferd.wire.names import default_runtime_dir
from kvxferd.wire import serving
from kvxferd.wire.samehost import boot_id
from kvxferd.wire.frames import reads_socket_path
from kvxferd.xfer.samehost import hostcopy

log = logging.getLogger("kvxferd.daemon")
EXIT_CONFIG, EXIT_STARTUP = 2, 3
GIL_SWITCH_INTERVAL_S = 200e-6
LOOP_STALL_S = 0.25  # the maintenance tick waking this late is logged and counted
IDLE_TICK_S = 1.0  # maintenance tick with nothing held and nothing read (idle CPU)
TLS_CHECK_S = 1.0  # how often the TLS files are looked at between handshakes (three stats)
PROBE_ON_READ_S = 1.0  # reads naming an unknown holder registration probe the link at most this often
REHANDSHAKE_MAX_WAIT_S = 60.0  # a stale link's probe-driven re-handshakes back off to one this often
# Full names (kvxfer.v1.*); importing the *_pb2 modules also puts their descriptors where reflection looks.
SERVICES = tuple(module.DESCRIPTOR.services_by_name[name].full_name
                 for module, name in ((engine_service_pb2, "EngineService"), (peer_service_pb2, "PeerService")))
PEER_SERVICE = SERVICES[1]


class Daemon:
    """Everything one ``kvxferd serve`` process runs."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.spans = DaemonSpans(config.daemon_id)  # OpenTelemetry: off unless OTEL_* asks (base/spans.py)
        self.tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca, server_name=config.peer_server_name,
                            allowed_ids=tuple(config.peer_allowed_ids)) if config.tls else None
        if self.tls is not None:
            check_own_chain(self.tls)  # as peers check it in their challenge: a CA they refuse stops us here
            self._ca_watch = CaWatch(self.tls.current().ca)
            self.tls.on_reload = self._tls_reloaded
            self.tls.on_refused = self.metrics.tls_refused.inc
            # The maintenance loop looks at the files every TLS_CHECK_S; refused_error stays set until they load.
            self.metrics.tls_files_unusable.set_function(lambda: 1.0 if self.tls.refused_error else 0.0)
        self.engine_token = read_token(config.engine_token_file) if config.engine_token_file else None
        self.socket_path = config.engine_socket_path
        self.reads = ReadPath(self)
        self.writes = WritePath(self)  # push, prefill side (issue #57)
        self.sessions = WorkerSessions(self)  # reads sessions handed to reader workers
        self.dataplane = DataPlane(self._reads_done_threadsafe, self._hold_events_threadsafe,
                                   on_expectations=self._expectations_threadsafe,
                                   interval_s=config.poll_interval_s,
                                   notice_interval_s=config.notice_poll_interval_s, metrics=self.metrics)
        self.peers = Peers(self.dataplane, self.metrics, timeout_s=config.handshake_timeout_s,
                           max_message_bytes=config.max_message_bytes, tls=self.tls,
                           server_name=config.peer_server_name, insecure=config.insecure)
        self.peers.push_targets = config.push_targets
        self.peers.same_host_writes = config.same_host_writes
        self.transports = self.peers.transports = TransportPaths(self.metrics.transport_paths)
        self.bus: NotifyBus | None = None
        self.registry: Registry | None = None
        self.addresses: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[grpc.aio.Server] = []
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._maintenance_due = asyncio.Event()  # an idle daemon's slow tick, cut short by a new hold
        self._workers_given_up = False  # PeerService health says NOT_SERVING while true (_peer_health)
        self._metrics_server = None
        self.peer_token_address = ""  # the address peer tokens must name
        self._fd_inbox: FdInbox | None = None
        self._reads_socket: ReadSocketServer | None = None
        self._owns_socket = False
        self._serving_record: str | None = None

    # ---- start --------------------------------------------------------------------
    @staticmethod
    def _same_host_possible() -> bool:
        """Same-host reads need this kernel's boot id. Host-memory copies also need process_vm_readv (a seccomp
        filter may refuse it): without, GPU caches are still copied, host memory goes over NIXL."""
        if not boot_id():
            log.warning("same-host reads off: this kernel has no boot id")
            return False
        if not hostcopy.available():
            log.warning("same-host reads of host memory off: process_vm_readv is refused here (seccomp?); "
                        "they go over NIXL")
        return True

    def _same_host_secret_with_tls(self) -> bytes | None:
        """With TLS the host secret file is for same-host reads alone: one that cannot be used (a bad mode,
        another owner, no writable directory) turns them off with a warning, not the daemon."""
        path = self.config.peer_secret_path
        try:
            return load_or_create_peer_secret(path)
        except (KvxferError, OSError) as err:
            log.warning("same-host reads off: the host secret file %s cannot be used: %s", path,
                        getattr(err, "message", None) or err)
            return None

    async def start(self) -> dict[str, str]:
        """Bind everything; raises :class:`StartupError` with the reason."""
        config = self.config
        self._loop = asyncio.get_running_loop()
        try:
            gid = group_id(config.engine_socket_group)
            allowed_uids = frozenset(config.allowed_uids)  # on every engine-side socket: SO_PEERCRED and ACLs
            if config.engine_socket is None:  # the default directory is ours alone (or our fallback: localsock.py)
                runtime_dir = claim_runtime_dir(os.path.dirname(self.socket_path), gid,
                                                default=config.runtime_dir is None, uids=allowed_uids)
                self.socket_path = os.path.join(runtime_dir, os.path.basename(self.socket_path))
            claim_unix_socket(self.socket_path)  # first: never touch a live daemon's files
            self._owns_socket = True
            self.dataplane.start()
            self.bus = NotifyBus(config.notify_host, config.notify_port, history=config.event_history,
                                 curve_secret_key=config.notify_curve_secret_key, client_keys=config.notify_client_keys,
                                 loop=self._loop, max_subscriptions=config.max_bus_subscriptions,
                                 on_refused=lambda reason: self.metrics.bus_subscriptions_refused.labels(reason).inc())
            with socket_umask(gid):
                self._fd_inbox = FdInbox(fd_socket_path(self.socket_path), allowed_uids=frozenset(config.allowed_uids),
                                         group=gid, max_fds=config.max_fds_per_token, max_tokens=config.max_fd_tokens,
                                         recv_timeout_s=config.fd_recv_timeout_s,
                                         max_fds_waiting=config.max_fds_waiting,
                                         on_refused=lambda reason: self.metrics.fd_socket_refused.labels(reason).inc())
            restrict_socket(self._fd_inbox.path, gid, allowed_uids)
            self.registry = Registry(self.dataplane, self.publish, daemon_id=config.daemon_id,
                                     default_lease_s=config.lease_s, max_lease_s=config.max_lease_s,
                                     fd_inbox=self._fd_inbox, max_engines=config.max_engines,
                                     max_registered_bytes=config.max_registered_bytes,
                                     max_holds=config.max_holds_per_engine, max_hold_s=config.max_hold_s,
                                     abort_drain_s=config.abort_drain_s,
                                     populate_host_memory=config.populate_host_memory, shm_group=gid,
                                     shm_uids=allowed_uids,
                                     workers=self._worker_options() if config.dataplane_workers else None)
            self.registry.on_session_event = self.sessions.on_event
            self.registry.on_closing = self.writes.engine_gone
            self.registry.require_rdma_vram = config.require_rdma_capable_vram
            self.registry.retire_s = config.drain_timeout_s  # an engine leaving lets its holds be read first
            for kind in MEMORY_KINDS:
                self.metrics.vram_regions.labels(kind).set_function(functools.partial(self.registry.num_vram_regions,
                                                                                      kind))
            self.metrics.bind_gauges(self.registry.num_holds, self._num_reads,
                                     lambda: len(self.registry.slots), self.registry.num_expectations)
            self.metrics.workers_given_up.set_function(self.registry.num_workers_given_up)
            self.metrics.wake_sets.set_function(self.dataplane.num_wake_sets)
            self.metrics.wake_set_mutes.set_function(lambda: self.dataplane.sets.wake_sets.num_mutes)
            self.metrics.insecure_listeners.set(len(insecure_listeners(config)))
            self._metrics_server, metrics_port = self.metrics.serve(config.metrics_host, config.metrics_port)
            engine_server = self._new_server(config.max_message_bytes)
            self._peer_cap = peer_cap = ConnectionCap(config.max_peer_connections_per_source,
                                     on_shut=self.metrics.peer_connections_closed.inc)
            peer_server = self._new_server(min(config.max_peer_request_bytes, config.max_message_bytes),
                                           peer_server_options(), interceptors=(peer_cap,))
            engine_grpc.add_EngineServiceServicer_to_server(EngineServicer(self), engine_server)
            peer_grpc.add_PeerServiceServicer_to_server(PeerServicer(self), peer_server)
            with socket_umask(gid):
                bind(engine_server, f"unix:{self.socket_path}")
            restrict_socket(self.socket_path, gid, allowed_uids)
            reads_path = reads_socket_path(self.socket_path)
            if config.reads_socket:
                self._reads_socket = ReadSocketServer(
                    self, reads_path, allowed_uids=frozenset(config.allowed_uids), group=gid,
                    max_frame_bytes=config.max_message_bytes, max_sessions=3 * config.max_engines,
                    hello_timeout_s=config.fd_recv_timeout_s)
                await self._reads_socket.start()
            elif os.path.exists(reads_path):  # a killed daemon's: clients would try it
                os.unlink(reads_path)
            if config.engine_tcp:  # TLS (server side) plus the bearer token checked per call
                tcp_port = bind(engine_server, config.engine_tcp, engine_tls(self.tls))
            peer_credentials = self.tls.server_credentials() if self.tls is not None else None
            peer_port = bind(peer_server, f"{bracket_host(config.peer_host)}:{config.peer_port}", peer_credentials)
            # Tokens name the address as dialed: only the advertised one (what engines are told), no alias.
            self.peer_token_address = f"{bracket_host(config.advertise_host or config.peer_host)}:{peer_port}"
            if self.tls is None:  # same-host peers prove themselves with the host's secret instead
                self.peers.secret = load_or_create_peer_secret(config.peer_secret_path)
            if config.same_host_reads and self._same_host_possible():
                # The host's secret proves a peer shares this host. With TLS it proves nothing else (certificates
                # authenticate), and only daemons that share the file (one pod, or a hostPath) prove it.
                self.peers.same_host_secret = self.peers.secret or self._same_host_secret_with_tls()
                self.registry.keep_passed_fds = self.peers.same_host_secret is not None
            for server in (engine_server, peer_server):
                await server.start()
                self._servers.append(server)
        except StartupError:
            await self._stop_parts()
            raise
        except (InvalidArgumentError, PermissionDeniedError) as err:  # a group, a directory we may not use
            await self._stop_parts()
            raise StartupError(str(err)) from None
        except Exception as err:  # zmq address in use, NIXL missing, ...
            await self._stop_parts()
            raise StartupError(f"{type(err).__name__}: {err}") from err
        for service in (*SERVICES, ""):
            await _set_health(self._health, service, health_pb2.HealthCheckResponse.SERVING)
        self._record_serving()
        host = config.advertise_host or config.peer_host
        self.addresses = {"engine": f"unix:{self.socket_path}", "peer": f"{bracket_host(host)}:{peer_port}",
                          "notify": self.bus.address, "metrics": f"http://{bracket_host(config.metrics_host)}:{metrics_port}/metrics"}
        if config.engine_tcp:
            self.addresses["engine_tcp"] = f"{config.engine_tcp.rsplit(':', 1)[0]}:{tcp_port}"
        self.spawn(self._maintenance())
        self.spawn(peer_cap.run(peer_port))
        log.info("daemon started", extra={**self.addresses, "daemon_id": config.daemon_id})
        return self.addresses

    def _record_serving(self) -> None:
        """Say where the engine socket is, for ``kvxferd health`` with no target (a container's HEALTHCHECK
        never sees this daemon's flags): :mod:`kvxferd.wire.serving`. Without it the daemon still serves."""
        runtime_dir = self.config.runtime_dir or default_runtime_dir()
        try:
            self._serving_record = serving.write_record(runtime_dir, self.socket_path)
        except OSError as err:
            log.warning("no serving record: `kvxferd health` without --target will not find this daemon",
                        extra={"runtime_dir": runtime_dir, "error": str(err)})

    def _new_server(self, max_request_bytes: int, port_options: list[tuple[str, int]] = (),
                    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> grpc.aio.Server:
        """A gRPC server; ``port_options`` replace or add to the common options, ``interceptors`` run before the
        call cap (the peer port's: peerport.py)."""
        config = self.config
        options = dict([("grpc.max_receive_message_length", max_request_bytes),
                        ("grpc.max_send_message_length", config.max_message_bytes), ("grpc.so_reuseport", 0),
                        ("grpc.max_concurrent_streams", http2_stream_limit(config.max_concurrent_streams))])
        options = list({**options, **dict(port_options)}.items())
        refused = self.metrics.rpc_errors
        cap = CallCap(config.max_concurrent_streams,
                      on_refused=lambda method: refused.labels(method, grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc())
        server = grpc.aio.server(options=options, interceptors=[*interceptors, cap])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if config.reflection if config.reflection is not None else not config.tls:
            reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    # ---- work handed between threads ------------------------------------------------
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run_blocking(self, fn, *args):
        """A short blocking call (NIXL metadata loading) off the event loop."""
        return await asyncio.to_thread(fn, *args)

    def publish(self, slot: EngineSlot, end: HoldEnd) -> None:
        """Publish a hold event on the bus (event-loop thread)."""
        self._publish_all([(slot, end)])

    def held(self, slot: EngineSlot, request_id: str) -> None:
        """A hold was placed: the pushes waiting for it start once the Hold was answered (issue #57)."""
        self._loop.call_soon(self.writes.on_hold, slot, request_id)

    def _publish_all(self, events: list[tuple[EngineSlot, HoldEnd]], counted_unix_s: float = 0.0) -> None:
        """A round's hold events on the bus, in order, then counted. An expectation's end (push, decode
        side) completes its read instead. ``counted_unix_s``: when the data-plane thread handed them over
        (for the spans; 0: now)."""
        counted_unix_s = counted_unix_s or (time.time() if self.spans.on else 0.0)
        late = [(slot, end) for slot, end in events if end.late_notice]
        if late:  # a notice after its hold ended: only a settling push waits for it, nobody else hears of it
            events = [(slot, end) for slot, end in events if not end.late_notice]
        if any(slot.expected for slot, _ in events):
            events = [(slot, end) for slot, end in events if not self.reads.expects.ended(slot, end)]
        for slot, end in late:  # after this round's ends: the push it names may have ended in this round
            self.reads.expects.late(slot, end)
        for slot, end in events:
            slot.awaited.discard(end.request_id)
        self.bus.publish_many([(slot.engine_id, end.kind.value, end.request_id, end.block_ids, end.reason)
                               for slot, end in events])
        for _, end in events:
            self.metrics.events.labels(end.kind.value).inc()
            if end.kind is EXPIRED and end.reason == "lease":
                self.metrics.leases_expired.inc()
        if self.spans.on:
            self.spans.hold_ends(events, counted_unix_s)

    def _hold_events_threadsafe(self, events: list[tuple[EngineSlot, HoldEnd]]) -> None:
        self._loop.call_soon_threadsafe(self._publish_all, events, time.time() if self.spans.on else 0.0)

    def _expectations_threadsafe(self, records: list) -> None:
        self._loop.call_soon_threadsafe(self.writes.expect_records, records)

    def _reads_done_threadsafe(self, finished: list[Read]) -> None:
        self._loop.call_soon_threadsafe(self.reads.done, finished)

    # ---- maintenance ----------------------------------------------------------------
    def wake_maintenance(self) -> None:
        """Something to expire or renew appeared (a first hold): back to the short tick now."""
        self._maintenance_due.set()

    def _has_work(self) -> bool:
        return any(len(slot.holds) or slot.reads for slot in self.registry.slots.values())

    async def _maintenance(self) -> None:
        tick_s = min(0.2, self.config.lease_s / 10)  # expiry is exact at notice time; the tick only publishes it
        renew_every_s = self.config.lease_s / 3
        last_renew = last_probe = last_tls_check = time.monotonic()
        while not self._stopping.is_set():
            busy, slept_from = self._has_work(), time.monotonic()
            wait_s = tick_s if busy else max(tick_s, IDLE_TICK_S)
            if busy:
                await asyncio.sleep(wait_s)
            else:  # nothing held, nothing read: engine leases and probes only, until a hold arrives
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._maintenance_due.wait(), wait_s)
            self._maintenance_due.clear()
            stalled_s = time.monotonic() - slept_from - wait_s  # < 0: woken early (a hold arrived)
            self._note_stall(stalled_s)
            try:
                self.transports.refresh()
                await self.registry.expire(max(stalled_s, 0.0))
                now = time.monotonic()
                if now - last_renew >= renew_every_s:
                    last_renew = now
                    self.spawn(self._renew_waiting_reads(time.perf_counter() - renew_every_s))
                if self.tls is not None and now - last_tls_check >= TLS_CHECK_S:
                    last_tls_check = now  # a rotation is used, or refused loudly, without waiting for a handshake
                    self.tls.current()
                    self.registry.check_trust(time.time())  # certificates metadata went to, near their expiry
                if now - last_probe >= self.config.peer_check_s:
                    last_probe = now
                    self.spawn(self._probe_peers())
                await self._peer_health()
            except Exception:
                log.exception("maintenance failed")

    def _worker_options(self) -> WorkerOptions:
        config, replacements = self.config, self.metrics.worker_replacements
        return WorkerOptions(config.poll_interval_s, config.worker_retire_grace_s, config.worker_replace_interval_s,
                             on_death=self.metrics.worker_deaths.inc, readers=config.dataplane_reader_workers,
                             on_replace=lambda reasons: [replacements.labels(r).inc() for r in reasons])

    def _tls_reloaded(self, material) -> None:
        """New TLS files (the thread that looked): counted; a CA withdrawn from the bundle ends trust in
        every peer the workers' metadata went to (kvxferd.service.workers.trust)."""
        self.metrics.tls_reloads.inc()
        registry, peer_cap = getattr(self, "registry", None), getattr(self, "_peer_cap", None)
        if self._ca_watch.withdrawn(material.ca) and registry is not None:
            # Connected peers were checked against the old bundle: each connects again and is checked anew.
            try:
                closed = peer_cap.shut_all() if peer_cap is not None else 0
            except OSError as err:  # the kernel's table cannot be asked: the connections idle out (60 s)
                log.warning("a CA was withdrawn; peer connections could not be closed", extra={"error": str(err)})
            else:
                log.warning("a CA was withdrawn from tls_ca; peer connections closed, workers replaced",
                            extra={"closed": closed})
            registry.replace_workers(CA_CHANGED)

    async def _peer_health(self) -> None:
        """PeerService is NOT_SERVING while an engine rank has no data-plane worker and none can start (its
        memory would not map again): the chart's readiness probe asks it, so peers stop being sent here
        until that engine registers again. Checked each maintenance tick; said only when it changes."""
        given_up = self.registry.num_workers_given_up()
        if bool(given_up) != self._workers_given_up and not self._stopping.is_set():
            self._workers_given_up = bool(given_up)
            status = health_pb2.HealthCheckResponse
            await _set_health(self._health, PEER_SERVICE, status.NOT_SERVING if given_up else status.SERVING)
            log.log(logging.ERROR if given_up else logging.INFO, "peer service %s",
                    "NOT_SERVING: a data-plane worker cannot start" if given_up else "SERVING again",
                    extra={"engine_ranks_without_worker": given_up})

    def _note_stall(self, late_s: float) -> None:
        """A loop that wakes late delays every completion and reply: count it, and say how late."""
        if late_s >= LOOP_STALL_S:
            self.metrics.loop_stalls.inc()
            log.warning("the event loop woke late (stopped, starved, or a blocking call on it)",
                        extra={"late_s": round(late_s, 3)})

    async def _renew_waiting_reads(self, received_before_s: float) -> None:
        """Reads still waiting keep the holders' leases alive (``received_before_s``: perf_counter)."""
        for slot in list(self.registry.slots.values()):
            by_remote: dict[str, list[str]] = {}
            for read in list(slot.reads.values()):
                if read.received_s <= received_before_s and read.verified:
                    by_remote.setdefault(read.remote_engine_id, []).append(read.request.remote_request_id)
            for remote_engine_id, request_ids in by_remote.items():
                link = slot.links.get(remote_engine_id)
                if link is not None:
                    await self.peers.renew(link, request_ids, self.config.lease_s)

    async def _probe_peers(self) -> None:
        for slot in list(self.registry.slots.values()):
            for link in list(slot.links.values()):
                await self._probe_link(slot, link)

    async def _probe_link(self, slot: EngineSlot, link: RemoteLink) -> None:
        """One GetIncarnation per remote rank; a changed or unreachable one makes the link re-handshake. A
        stale link (a failed read, a holder restarting: a daemon or a data-plane worker, this rank's own
        worker replaced) is handshaken again here, so it heals before the next read rather than costing
        that read a handshake; failures back off (peer_check_s doubling to REHANDSHAKE_MAX_WAIT_S), so a
        holder gone for good costs a try a minute."""
        if link.stale and link.remote is not None and link.pending is None:
            if time.monotonic() >= link.retry_s:
                self.spawn(self._rehandshake(slot, link))
            return
        if link.ready and not await self.peers.probe(slot, link):
            link.stale = True
            # A holder gone or restarted: do not keep its engine's shared memory mapped (and alive) here.
            slot.executor.release_host_memory(link.remote, "the holder changed incarnation or is unreachable")
            log.info("remote engine changed incarnation or is unreachable",
                     extra={"engine_id": slot.engine_id, "remote_engine_id": link.remote_engine_id})
            self.spawn(self._rehandshake(slot, link))

    def probe_soon(self, slot: EngineSlot, link: RemoteLink) -> None:
        """A read named a holder registration the link does not know: probe now, at most once a second per
        link (a key id comes from the engine's input, so it may be made up; only a real change of
        incarnation makes the link re-handshake, never the key id itself)."""
        now = time.monotonic()
        if now - link.checked_s >= PROBE_ON_READ_S:
            link.checked_s = now
            self.spawn(self._probe_link(slot, link))

    async def _rehandshake(self, slot: EngineSlot, link: RemoteLink) -> None:
        try:
            await self.peers.handshake(slot, link.remote_engine_id)
        except KvxferError as err:
            link.failed_rehandshakes += 1
            link.retry_s = time.monotonic() + min(REHANDSHAKE_MAX_WAIT_S, self.config.peer_check_s * 2.0 ** (
                link.failed_rehandshakes - 1))
            log.log(logging.WARNING if link.failed_rehandshakes == 1 else logging.DEBUG,
                    "re-handshake failed; retried by the next probe or read",
                    extra={"engine_id": slot.engine_id, "remote_engine_id": link.remote_engine_id, "error": str(err),
                           "failures_in_a_row": link.failed_rehandshakes})

    def _num_reads(self) -> int:
        """Reads in flight: on the data-plane thread, and in reader workers serving engines' sessions."""
        slots = self.registry.slots.values() if self.registry is not None else ()
        return self.dataplane.num_reads + sum(slot.worker_reads_in_flight for slot in slots)

    # ---- stop -----------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def shutdown(self) -> None:
        """Drain, deregister every engine, stop every server and thread."""
        self._stopping.set()
        self.registry.accepting = False
        self.sessions.drain()
        for service in (*SERVICES, ""):
            await _set_health(self._health, service, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.config.drain_timeout_s
        # (and engines that left just before: the readers of their holds; the native sidecar order)
        while (self._num_reads() or self.registry.num_retiring) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        left = self._num_reads()
        await self.registry.finish_retiring()  # (before the data plane stops: their memory goes through it)
        log.info("drained", extra={"reads_failed": left})
        for slot in list(self.registry.slots.values()):
            await self.registry.deregister(slot, "daemon shutting down")
        await self._stop_parts()

    async def _stop_parts(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            await server.stop(grace=1.0)
        self._servers.clear()
        await self.peers.close()
        self.dataplane.stop()
        if self.bus is not None:
            self.bus.close()
        if self._fd_inbox is not None:
            self._fd_inbox.close()
        if self._reads_socket is not None:
            self._reads_socket.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._serving_record is not None:
            serving.remove_record(self._serving_record)
        if self._owns_socket and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.transports.refresh()  # the last UCX warnings, then the files go
        self.transports.close()
        self.spans.close()


async def _set_health(servicer, service: str, status) -> None:
    result = servicer.set(service, status)
    if asyncio.iscoroutine(result):
        await result


async def serve(config: DaemonConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    # The event loop and the data-plane thread hand work to each other all the
    # time; the default 5 ms GIL switch interval would add up to that to a hand-off.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    reason = refusal(config) or rdma_refusal(config.require_rdma_capable_vram)
    if reason is not None:
        log.error("refusing to start", extra={"error": reason})
        print(f"kvxferd: refusing to start: {reason}", flush=True)
        return EXIT_CONFIG
    exposed = insecure_listeners(config)
    if exposed:
        log.warning("INSECURE: listeners reachable from other hosts without authentication (--insecure)",
                    extra={"listeners": ",".join(exposed)})
    daemon = None
    try:
        # Before the first NIXL agent: UCX reads its configuration when an agent is created.
        os.environ.update(ucx_environment(config))  # UCX_NET_DEVICES[, UCX_TCP_PORT_RANGE]
        daemon = Daemon(config)
        if config.transport_check:  # UCX reports the paths it chooses (base/transports.py)
            os.environ.update(daemon.transports.environment())
        addresses = await daemon.start()
    except (InvalidArgumentError, StartupError) as err:
        log.error("start-up failed", extra={"error": str(err)})
        print(f"kvxferd: start-up failed: {err}", flush=True)
        if daemon is not None:
            daemon.transports.close()
        return EXIT_STARTUP
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    print("kvxferd ready: " + " ".join(f"{k}={v}" for k, v in addresses.items()), flush=True)
    await daemon.wait_stopped()
    log.info("shutting down")
    await daemon.shutdown()
    return 0
