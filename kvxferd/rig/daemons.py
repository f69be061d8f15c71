"""The rig's daemons: real ``kvxferd serve`` processes, as a test cluster, as the soak's restartable set,
and on the fabric's namespace hosts.

**A daemon cluster** (:class:`DaemonCluster`), the end-to-end proof: every
TP rank of a prefill and a decode engine gets its own ``kvxferd serve``
process; the engine ranks are host caches in POSIX shared memory,
registered over gRPC from this process. A request is held on every prefill
rank, read by every decode rank through its daemon, checked byte for byte
against the oracle, and the prefill side must see exactly one CONSUMED
event per rank.

**The soak's daemons** (:class:`DaemonSet`, :class:`DaemonLife`): one per
rank, killed, frozen and restarted at the same addresses. Each is started
once on free ports; a restart passes the same engine socket, peer, notify
and metrics ports, as a pod restarted behind the same Service would. What a
surviving daemon uses is measured from ``/proc`` (fds, shared-memory
mappings, threads, RSS) to find leaks.

**Daemons on namespace hosts** (:class:`NamespaceDaemon`, :class:`ChartPorts`,
:class:`Pki`), configured as the chart runs them across real hosts. Rank
``i`` of a role on a host listens as container ``kvxferd-<i>`` of the
chart's pod does: the peer port ``ports.peer + i`` on the host's address with
mutual TLS (a throw-away CA; every daemon's certificate carries the release's
SPIFFE id, which the allow-list names), the notify bus ``ports.notify + i``
and metrics ``ports.metrics + i`` on the host's loopback, UCX's tcp
transport on the host's ``eth0`` within ``ports.ucx``. Each host has its own
host secret, so no daemon takes another host's daemon for a neighbour.
UCX's shared-memory transports are switched off (``UCX_TLS=tcp``): these
hosts share one kernel, and UCX would otherwise carry their bytes through
shared memory instead of the link (the tests count the link's bytes).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvxferd.client import DaemonProcess, EngineClient, NotifySubscriber, SharedArena, engine_rank_pb
from kvxferd.client.fdsend import send_fds
from kvxferd.plan.capability import PUSH_KEY_BYTES, push_key_digest
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.verify.buffers import DecodeChecks, EngineBuffers, allocate_engine
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.verify.hosts.fabric import Host
from kvxferd.rig.verify.hosts.nsenter import call_in_netns
from kvxferd.rig.verify.hosts.policy import chart_values, release_config
from kvxferd.wire.names import fd_socket_path


class DaemonCluster(DecodeChecks):
    """A prefill engine (TP ``prefill_tp``) and a decode engine (TP ``decode_tp``), one daemon per rank."""

    def __init__(self, prefill_groups: Sequence[CacheGroup], decode_groups: Sequence[CacheGroup],
                 prefill_tp: int, decode_tp: int, *, workdir: str, name: str = "c", lease_s: float = 30.0,
                 daemon_args: tuple[str, ...] = (), reads_socket: bool = True,
                 args_of=None, by_fd: bool = False, start_many=None) -> None:
        """``reads_socket=False``: the decode clients' Reads sessions go over gRPC, not the daemon's reads socket; ``args_of``:
        more flags for one daemon, by its id (``<name>-p<q>``, ``<name>-d<r>``); ``by_fd``: engines pass their
        shared memory as an fd over the fd socket (``shm_fd_index``, as the vLLM connector does), not by name;
        ``start_many``: starts the daemons instead of :meth:`DaemonProcess.start_many` (same arguments), e.g. on
        namespace hosts."""
        self.reads_socket = reads_socket
        self.prefill_groups, self.decode_groups = tuple(prefill_groups), tuple(decode_groups)
        self.prefill_id, self.decode_id = f"{name}-prefill", f"{name}-decode"
        self.workdir, self.lease_s, self.daemon_args, self.args_of = workdir, lease_s, daemon_args, args_of
        self.by_fd = by_fd
        self.capabilities: dict[str, tuple[bytes, ...]] = {}  # remote request id -> its last hold's, per rank
        self.digests: dict[str, tuple[bytes, ...]] = {}  # remote request id -> its last hold's digests, per rank
        self.push_keys: dict[str, bytes] = {}  # transfer id -> its push key (push, issue #57)
        self.arenas: list[SharedArena] = []
        self.daemons: list[DaemonProcess] = []
        self.clients: list[EngineClient] = []
        self.subscribers: list[NotifySubscriber] = []
        try:
            ids = [f"{name}-p{q}" for q in range(prefill_tp)] + [f"{name}-d{r}" for r in range(decode_tp)]
            self.daemons = (start_many or DaemonProcess.start_many)(ids, socket_dir=workdir, extra_args=daemon_args,
                                                                    args_of=args_of)
            self.prefill = [self._engine(self.prefill_id, prefill_groups, prefill_tp, q, True) for q in range(prefill_tp)]
            self.decode = [self._engine(self.decode_id, decode_groups, decode_tp, r, False) for r in range(decode_tp)]
            # Registration creates a NIXL agent (about a second): all ranks at once.
            with ThreadPoolExecutor(len(self.daemons)) as pool:
                clients = list(pool.map(self._register, self.daemons, self.prefill + self.decode))
            self.prefill_clients, self.decode_clients = clients[:prefill_tp], clients[prefill_tp:]
            self.subscribers = [NotifySubscriber(c) for c in self.prefill_clients]
            self.handshake()
        except BaseException:
            self.close()
            raise

    @property
    def prefill_daemons(self) -> list[DaemonProcess]:
        return self.daemons[: len(self.prefill)]

    @property
    def decode_daemons(self) -> list[DaemonProcess]:
        return self.daemons[len(self.prefill):]

    def _engine(self, engine_id, groups, tp_size, rank, tagged) -> EngineBuffers:
        def allocate(num_bytes):
            self.arenas.append(SharedArena(num_bytes))
            return self.arenas[-1].array
        return allocate_engine(engine_id, groups, tp_size, rank, tagged=tagged, allocate=allocate)

    def _register(self, daemon: DaemonProcess, engine: EngineBuffers) -> EngineClient:
        client = EngineClient(daemon.engine_target, reads_socket=self.reads_socket)
        self.clients.append(client)
        arena = next(a for a in self.arenas if a.array.ctypes.data == engine.arena.ctypes.data)
        message, token = engine_rank_pb(engine.cache, arena), ""
        if self.by_fd:
            for region in (r for group in message.groups for r in group.regions):
                region.handle.shm_fd_index = 0  # the one fd sent below, instead of the name
            token = secrets.token_hex(16)
            fd = os.open(os.path.join("/dev/shm", arena.name), os.O_RDWR | os.O_CLOEXEC)
            try:
                send_fds(fd_socket_path(daemon.socket), token, [fd])
            finally:
                os.close(fd)
        client.register(message, lease_s=self.lease_s, fd_token=token)
        return client

    def restart_prefill(self, q: int, *, down_s: float = 0.0) -> None:
        """Stop prefill rank ``q``'s daemon (SIGTERM), start a new one on the same addresses, re-register.

        The engine's cache (shared memory) survives; the new daemon has a
        new incarnation, so decode daemons must re-handshake. ``down_s``
        keeps the rank down that long, so peers' probes see it gone.
        """
        old = self.daemons[q]
        old.terminate()
        time.sleep(down_s)
        self.daemons[q] = DaemonProcess(old.daemon_id, socket_dir=self.workdir,
                                        extra_args=(*self.daemon_args, *(self.args_of(old.daemon_id) if self.args_of
                                                                          else ()), *old.port_args(("peer",))))
        self.subscribers[q].close()
        self.prefill_clients[q].close()
        self.prefill_clients[q] = self._register(self.daemons[q], self.prefill[q])
        self.subscribers[q] = NotifySubscriber(self.prefill_clients[q])

    def handshake(self) -> None:
        addresses = [d.peer_address for d in self.prefill_daemons]
        for client in self.decode_clients:
            client.handshake(self.prefill_id, addresses)

    def push_key(self, transfer_id: str) -> bytes:
        """The push key of a transfer (random, made on first use), as the proxy makes one per request."""
        return self.push_keys.setdefault(transfer_id, os.urandom(PUSH_KEY_BYTES))

    def hold(self, request: ReadRequest, *, lease_s: float = 0.0, push: bool = False,
             layers_final=(), want_digests: bool = False, traceparent: str = "") -> tuple[bytes, ...]:
        """Hold on every prefill rank; the ranks' capabilities (also kept for :meth:`submit`). ``push``: with
        the digest of the transfer's push key (:meth:`push_key`), so decode ranks presenting it get it written
        (``layers_final``: layer by layer, :meth:`final_layers` says when more are final). ``want_digests``: the
        ranks' digests of the held blocks are kept too (``digests``; :meth:`submit` with ``digests``)."""
        digest = push_key_digest(self.push_key(request.remote_request_id)) if push else b""
        held = [client.hold(request.remote_request_id, request.remote_block_ids, lease_s=lease_s,
                            push_key_digest=digest, layers_final=layers_final, want_digests=want_digests,
                            traceparent=traceparent)
                for client in self.prefill_clients]
        capabilities = tuple(h.capability for h in held)
        self.capabilities[request.remote_request_id] = capabilities
        self.digests[request.remote_request_id] = tuple(h.digests for h in held)
        return capabilities

    def final_layers(self, request: ReadRequest, layers_final) -> None:
        """Every prefill rank says ``layers_final`` (per group) of its push's hold are final."""
        for client in self.prefill_clients:
            client.final_layers(request.remote_request_id, layers_final)

    def submit(self, request: ReadRequest, *, deadline_s: float = 0.0, digests: bool = False,
               traceparent: str = "") -> None:
        """Every decode rank submits ``request`` (a batch of one on its session) with
        ``request.remote_capabilities``, else those of the cluster's last hold of its remote request (and,
        with ``digests``, that hold's digests: the daemons check the blocks against them)."""
        capabilities = request.remote_capabilities or self.capabilities.get(request.remote_request_id, ())
        remote_digests = self.digests.get(request.remote_request_id, ()) if digests else ()
        for client in self.decode_clients:
            client.submit_read(request.request_id, self.prefill_id, request.remote_request_id,
                               request.local_block_ids, request.remote_block_ids,
                               num_tokens=request.num_tokens or 0, deadline_s=deadline_s,
                               remote_capabilities=capabilities, remote_digests=remote_digests,
                               traceparent=traceparent)

    def completions(self, request: ReadRequest, timeout_s: float = 30.0) -> list[pb.Completion]:
        return [client.reads.wait_completion(request.request_id, timeout_s) for client in self.decode_clients]

    def read(self, request: ReadRequest, timeout_s: float = 30.0, *, hold: bool = True) -> list[pb.Completion]:
        """Hold on every prefill rank, read on every decode rank, return the completions."""
        if hold:
            self.hold(request)
        self.submit(request)
        return self.completions(request, timeout_s)

    def expect(self, request: ReadRequest, *, deadline_s: float = 0.0, push_key: bytes | None = None) -> None:
        """Every decode rank expects ``request`` (its decode blocks, the transfer id ``remote_request_id``)
        with the transfer's push key (or ``push_key``)."""
        key = self.push_key(request.remote_request_id) if push_key is None else push_key
        for client in self.decode_clients:
            client.submit_push(request.request_id, self.prefill_id, request.remote_request_id, key,
                               request.local_block_ids, num_tokens=request.num_tokens or 0, deadline_s=deadline_s)

    def push(self, request: ReadRequest, timeout_s: float = 30.0, *, hold_first: bool = False,
             deadline_s: float = 0.0, push_key: bytes | None = None) -> list[pb.Completion]:
        """Push (issue #57): every decode rank expects ``request`` (:meth:`expect`), every prefill rank holds
        it with the push key's digest (first, with ``hold_first``; else after the expectations went out, as a
        concurrent dispatch would); the decode completions."""
        if hold_first:
            self.hold(request, push=True)
        self.expect(request, deadline_s=deadline_s, push_key=push_key)
        if not hold_first:
            self.hold(request, push=True)
        return self.completions(request, timeout_s)

    def hold_events(self, request: ReadRequest, timeout_s: float = 10.0) -> list[pb.NotifyEvent | None]:
        """The terminal event (CONSUMED or EXPIRED) of every prefill rank for ``request``."""
        return [s.wait_for(request.remote_request_id, timeout_s=timeout_s) for s in self.subscribers]

    def close(self) -> None:
        """Deregister, stop the daemons (SIGTERM), free the shared memory."""
        for subscriber in self.subscribers:
            subscriber.close()
        for client in self.clients:
            client.close()
        for daemon in self.daemons:
            daemon.terminate()
        for arena in self.arenas:
            arena.close()


@dataclass
class DaemonLife:
    """One rank's daemon and what happened to it."""

    daemon: DaemonProcess
    role: str  # prefill | decode
    index: int  # rank within its role
    start_again: Callable[[DaemonProcess], DaemonProcess]  # a new daemon at the old one's addresses
    stopped_since: float | None = None
    frozen: list[tuple[float, float]] = field(default_factory=list)  # (SIGSTOP, SIGCONT) monotonic times

    def frozen_during(self, start_s: float, end_s: float) -> float:
        """Seconds this daemon was frozen between ``start_s`` and ``end_s``."""
        spans = self.frozen + ([(self.stopped_since, end_s)] if self.stopped_since is not None else [])
        return sum(max(0.0, min(end_s, stop) - max(start_s, begin)) for begin, stop in spans)


class DaemonSet:
    """Prefill daemons (one per rank) and one or more sets of decode daemons, of which one serves now."""

    def __init__(self, prefill: list[DaemonLife], decode_sets: list[list[DaemonLife]]) -> None:
        self.prefill, self.decode_sets = prefill, decode_sets
        self.current = 0  # the decode set the pairing uses (--hosts: decode hosts take turns)

    @classmethod
    def loopback(cls, num_prefill: int, num_decode: int, workdir: str, daemon_args: tuple[str, ...],
                 module: str = "kvxferd") -> "DaemonSet":
        """Every daemon on this host's loopback, in one work directory (``module``: as DaemonProcess's)."""
        ids = [f"soak-p{q}" for q in range(num_prefill)] + [f"soak-d{r}" for r in range(num_decode)]
        started = DaemonProcess.start_many(ids, socket_dir=workdir, extra_args=daemon_args, module=module)

        def again(old: DaemonProcess) -> DaemonProcess:
            return DaemonProcess(old.daemon_id, socket_dir=workdir, extra_args=(*daemon_args, *old.port_args()),
                                 ready_timeout_s=60, module=module)

        return cls([DaemonLife(d, "prefill", q, again) for q, d in enumerate(started[:num_prefill])],
                   [[DaemonLife(d, "decode", r, again) for r, d in enumerate(started[num_prefill:])]])

    @property
    def decode(self) -> list[DaemonLife]:
        return self.decode_sets[self.current]

    @property
    def all(self) -> list[DaemonLife]:
        return self.prefill + [life for lives in self.decode_sets for life in lives]

    def kill(self, life: DaemonLife) -> None:
        """``kill -9``: no drain, no goodbye; sockets and shared-memory mappings die with it."""
        life.daemon.kill()
        life.stopped_since = None

    def restart(self, life: DaemonLife) -> float:
        """A new daemon at the killed one's addresses; seconds until it is ready."""
        old = life.daemon
        start = time.monotonic()
        for attempt in range(20):  # the old sockets may linger a moment after kill -9
            try:
                life.daemon = life.start_again(old)
                break
            except RuntimeError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        return time.monotonic() - start

    def stop(self, life: DaemonLife) -> None:
        """SIGSTOP: the daemon hangs (a frozen peer, a partition) until :meth:`cont`."""
        os.kill(life.daemon.process.pid, signal.SIGSTOP)
        life.stopped_since = time.monotonic()

    def cont(self, life: DaemonLife) -> None:
        if life.stopped_since is not None:
            os.kill(life.daemon.process.pid, signal.SIGCONT)
            life.frozen.append((life.stopped_since, time.monotonic()))
            life.stopped_since = None

    def crashed(self) -> list[str]:
        """Daemons that exited although nothing killed them (each life is checked)."""
        return [f"{life.daemon.daemon_id} exited with {life.daemon.process.poll()}: {life.daemon.tail(600)}"
                for life in self.all if life.daemon.process.poll() is not None]

    def close(self) -> None:
        for life in self.all:
            self.cont(life)
            life.daemon.terminate()


def _role_of(words: list[bytes]) -> str:
    """A worker's role, from its command line (``--role``; holder when absent)."""
    return words[words.index(b"--role") + 1].decode() if b"--role" in words[:-1] else "holder"


def dataplane_workers(pid: int, role: str | None = None) -> list[int]:
    """The live data-plane workers (``dataplane_workers``) daemon ``pid`` started (``role``: holder or
    reader only)."""
    workers = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as children:
                kids = [int(k) for k in children.read().split()]
        except FileNotFoundError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/cmdline", "rb") as cmdline:
                    words = cmdline.read().split(b"\0")
                    if b"kvxferd.worker" in words and (role is None or _role_of(words) == role):
                        workers.append(kid)
            except FileNotFoundError:
                pass
    return workers


def usage(pid: int) -> dict[str, int]:
    """What one process holds: open fds, threads, resident bytes, and its shared-memory mappings: engine
    arenas (``psm_*``, which must be gone once no engine is registered) and the rest (UCX's own segments)."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    kinds: dict[str, int] = {}
    fds = os.listdir(f"/proc/{pid}/fd")
    engine_fds = 0  # engine arenas held open (data-plane workers are handed them), not only mapped
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target else ("/dev/shm" if target.startswith("/dev/shm") else "file")
        kinds[kind] = kinds.get(kind, 0) + 1
        engine_fds += target.startswith("/dev/shm/psm_")
    with open(f"/proc/{pid}/maps") as maps:
        shm = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/" in line}
    engine_shm = sorted(name for name in shm if "/dev/shm/psm_" in name)
    return {"fds": len(fds), "engine_shm": engine_shm, "engine_shm_fds": engine_fds,
            "other_shm_mappings": len(shm) - len(engine_shm), "fd_kinds": kinds,
            "threads": int(fields["Threads"]), "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024}


def measure(life: DaemonLife) -> dict:
    """What a daemon holds now, with its pid (a new pid is a new life), its registered engines and its
    data-plane workers (one per registered engine rank, with ``--dataplane-workers``)."""
    pid = life.daemon.process.pid
    return {"pid": pid, **usage(pid), "engines_registered": life.daemon.metric("kvxferd_engines_registered"),
            "dataplane_workers": len(dataplane_workers(pid))}


# What a surviving daemon may grow by between the first pairing and the end of the run: peer channels
# and UCX endpoints to daemons restarted since, allocator slack. Anything per request would exceed it.
LEAK_SLACK = {"fds": 16, "threads": 4, "rss_bytes": 64 << 20, "other_shm_mappings": 4}


def leaks(start: dict | None, end: dict) -> list[str]:
    """What a daemon holds at the end that it should not, with no engine registered."""
    problems = []
    if end["engine_shm"] or end["engine_shm_fds"] or end["engines_registered"] or end["dataplane_workers"]:
        problems.append(f"engine memory {end['engine_shm']} ({end['engine_shm_fds']} fds), "
                        f"{end['engines_registered']:g} engines registered and {end['dataplane_workers']} data-plane "
                        f"workers with no engine left")
    if start is not None and start["pid"] == end["pid"]:  # a killed daemon's new life has nothing to compare with
        problems += [f"{key} {start[key]} -> {end[key]} (allowed +{slack})"
                     for key, slack in LEAK_SLACK.items() if end[key] - start[key] > slack]
    return problems


UCX_TRANSPORTS = "tcp"


@dataclasses.dataclass(frozen=True)
class ChartPorts:
    """The chart's port bases and UCX range (values.yaml ``ports``)."""

    peer: int
    notify: int
    metrics: int
    ucx_low: int
    ucx_high: int

    @classmethod
    def from_chart(cls) -> "ChartPorts":
        ports = chart_values()["ports"]
        return cls(int(ports["peer"]), int(ports["notify"]), int(ports["metrics"]), int(ports["ucx"]["min"]),
                   int(ports["ucx"]["max"]))

    @property
    def ucx_range(self) -> str:
        return f"{self.ucx_low}-{self.ucx_high}"


class Pki:
    """A throw-away CA and one certificate per name, with the release's identity and server name (as rendered)."""

    def __init__(self, directory: str) -> None:
        self.ca = DevCA(directory, name="kvxferd fabric CA")
        config = release_config()
        (self.identity,) = config["peer_allowed_ids"]
        self.server_name = config["peer_server_name"]

    def client_files(self, name: str) -> tuple[str, str, str]:
        """``(ca, cert, key)`` paths of a new certificate with the release's identity (a raw NIXL baseline's)."""
        issued = self.ca.issue(name, dns_names=(self.server_name,), spiffe_id=self.identity)
        return str(self.ca.cert_path), str(issued.cert), str(issued.key)

    def tls_args(self, name: str, *, spiffe_id: str | None = None) -> tuple[str, ...]:
        """The daemon flags for mutual TLS with a certificate issued to ``name`` (another identity: ``spiffe_id``)."""
        issued = self.ca.issue(name, dns_names=(self.server_name,), spiffe_id=spiffe_id or self.identity)
        return ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(self.ca.cert_path),
                "--peer-allowed-ids", self.identity, "--peer-server-name", self.server_name)


class NamespaceDaemon(DaemonProcess):
    """A ``kvxferd serve`` inside a host's namespace; its metrics are read from inside it too."""

    def __init__(self, daemon_id: str, host: Host, **kwargs) -> None:
        self.host = host
        super().__init__(daemon_id, prefix=("ip", "netns", "exec", host.netns), **kwargs)

    def metrics_text(self) -> str:
        return call_in_netns(self.host.netns, super().metrics_text)

    def start_again(self) -> "NamespaceDaemon":
        """A new daemon with this one's flags, addresses and host (a restart in place)."""
        return NamespaceDaemon(self.daemon_id, self.host, socket_dir=os.path.dirname(self.log_path), env=self._env,
                               extra_args=self._extra_args, ready_timeout_s=60, module=self.module)


def ucx_environment(host: Host, ports: ChartPorts) -> dict[str, str]:
    """UCX settings for anything on ``host`` that makes a NIXL agent (daemons, raw baselines)."""
    return {"UCX_TLS": UCX_TRANSPORTS, "UCX_NET_DEVICES": host.interface, "UCX_TCP_PORT_RANGE": ports.ucx_range}


def daemon_args(host: Host, rank: int, ports: ChartPorts, pki: Pki, host_dir: str) -> tuple[str, ...]:
    """Every flag of rank ``rank``'s daemon on ``host`` (as the chart's container ``kvxferd-<rank>``)."""
    return ("--peer-host", host.address, "--peer-port", str(ports.peer + rank),
            "--notify-port", str(ports.notify + rank), "--metrics-port", str(ports.metrics + rank),
            "--ucx-tcp-port-range", ports.ucx_range, "--peer-secret-file", os.path.join(host_dir, "peer.secret"),
            *pki.tls_args(f"{host.name}-{rank}"))


def host_dir(workdir: str, host: Host) -> str:
    """``host``'s private directory under ``workdir`` (its host secret; sockets and logs where wanted)."""
    path = os.path.join(workdir, host.name)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def host_daemon(daemon_id: str, host: Host, rank: int, *, workdir: str, pki: Pki, ports: ChartPorts,
                socket_dir: str | None = None, extra_args: tuple[str, ...] = (),
                module: str = "kvxferd") -> NamespaceDaemon:
    """Start (not wait for) rank ``rank``'s daemon on ``host``, as the chart's container ``kvxferd-<rank>``;
    its socket and log in ``socket_dir`` (default: the host's directory; ``module``: as DaemonProcess's)."""
    private = host_dir(workdir, host)
    return NamespaceDaemon(daemon_id, host, socket_dir=socket_dir or private, wait=False,
                           env=ucx_environment(host, ports), module=module,
                           extra_args=(*daemon_args(host, rank, ports, pki, private), *extra_args))


def start_host_daemons(host: Host, role: str, count: int, *, workdir: str, pki: Pki, ports: ChartPorts,
                       extra_args: tuple[str, ...] = (), module: str = "kvxferd") -> list[NamespaceDaemon]:
    """``count`` daemons of ``role`` on ``host`` (ranks 0..count-1), started at once, each waited for."""
    return NamespaceDaemon.wait_all([host_daemon(f"{host.name}-{role}{rank}", host, rank, workdir=workdir, pki=pki,
                                                 ports=ports, extra_args=extra_args, module=module)
                                     for rank in range(count)])
