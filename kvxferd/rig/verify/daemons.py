"""Prefill and decode engines behind real daemons: the end-to-end proof.

Every TP rank gets its own ``kvxferd serve`` process; the engine ranks are
host caches in POSIX shared memory, registered over gRPC from this process.
A request is held on every prefill rank, read by every decode rank through
its daemon, checked byte for byte against the oracle, and the prefill side
must see exactly one CONSUMED event per rank.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvxferd.client import DaemonProcess, EngineClient, NotifySubscriber, SharedArena, engine_rank_pb
from kvxferd.client.fdsend import send_fds
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.verify.engines import DecodeChecks, EngineBuffers, allocate_engine
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

    def hold(self, request: ReadRequest, *, lease_s: float = 0.0) -> tuple[bytes, ...]:
        """Hold on every prefill rank; the ranks' capabilities (also kept for :meth:`submit`)."""
        capabilities = tuple(client.hold(request.remote_request_id, request.remote_block_ids, lease_s=lease_s).capability
                             for client in self.prefill_clients)
        self.capabilities[request.remote_request_id] = capabilities
        return capabilities

    def submit(self, request: ReadRequest, *, deadline_s: float = 0.0) -> None:
        """Every decode rank submits ``request`` (a batch of one on its session) with
        ``request.remote_capabilities``, else those of the cluster's last hold of its remote request."""
        capabilities = request.remote_capabilities or self.capabilities.get(request.remote_request_id, ())
        for client in self.decode_clients:
            client.submit_read(request.request_id, self.prefill_id, request.remote_request_id,
                               request.local_block_ids, request.remote_block_ids,
                               num_tokens=request.num_tokens or 0, deadline_s=deadline_s,
                               remote_capabilities=capabilities)

    def completions(self, request: ReadRequest, timeout_s: float = 30.0) -> list[pb.Completion]:
        return [client.reads.wait_completion(request.request_id, timeout_s) for client in self.decode_clients]

    def read(self, request: ReadRequest, timeout_s: float = 30.0, *, hold: bool = True) -> list[pb.Completion]:
        """Hold on every prefill rank, read on every decode rank, return the completions."""
        if hold:
            self.hold(request)
        self.submit(request)
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
