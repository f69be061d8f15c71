"""Engine registrations: memory in, NIXL registration, and memory out again.

Register::

    validate the message ─► open every region (shm / CUDA IPC / VMM fd)
      ─► new NIXL agent (name carries the incarnation) ─► register memory
      ─► slot joins the data-plane thread

Deregister (RPC, lapsed heartbeats, re-registration, shutdown), in this
order, so no read can touch memory that is going away::

    refuse new work ─► end holds (EXPIRED) ─► fail the slot's reads
      ─► disconnect remotes, deregister NIXL memory ─► unmap ─► end streams
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvxferd.errors import (AlreadyExistsError, InvalidArgumentError, KvxferError, NotFoundError,
                            ResourceExhaustedError, UnauthenticatedError, UnavailableError)
from kvxferd.plan.leases import HoldEnd
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.fdpass import FdInbox
from kvxferd.service.engines.gpu import GpuMapping, VmmOffers, check_servable
from kvxferd.service.engines.lifeline import ProcessWatch, process_of
from kvxferd.service.engines.memory import KeptFds, ShmOpeners, open_region, populate
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.wire.messages import check_id, check_seconds, engine_from_pb, groups_from_pb
from kvxferd.xfer.nixl.agent import NixlAgent, collect_agents
from kvxferd.plan.board import buckets_for
from kvxferd.service.workers.readbackend import WorkerReadBackend
from kvxferd.service.engines.served import AgentlessSlot, WorkerOptions, WorkerServed
from kvxferd.xfer.boardmemory import BoardMemory
from kvxferd.service.workers.trust import CERTIFICATE_EXPIRES
from kvxferd.xfer.holder import Holder
from kvxferd.xfer.reads import ReadExecutor

log = logging.getLogger("kvxferd.engines")
SESSION_BYTES = 32  # secrets.token_urlsafe: 43 URL-safe characters
# What this daemon issues (the length follows from SESSION_BYTES); anything else is not kept.
_SESSION_FORMAT = re.compile(rf"[A-Za-z0-9_-]{{{len(secrets.token_urlsafe(SESSION_BYTES))}}}")
RETIRE_POLL_S = 0.02  # how often a leaving engine's holds are looked at
MAX_EXPIRIES_PER_TICK = 8192  # per engine and maintenance tick (0.2 s): 40,000 a second
# The maintenance tick comes at least every second (daemon.IDLE_TICK_S). A longer gap means this
# daemon did not run (SIGSTOP, a paused VM or container, a starved host); see Registry.expire.
PAUSE_S = 2.0
# A worker whose metadata went to a certificate is replaced this long (plus its grace and the least time
# between replacements) before that certificate expires: a start on a loaded machine, readers' probes.
TRUST_LEAD_S = 60.0


class SlotThread(Protocol):
    """What the engines layer asks of the data-plane thread. ``service/dataplane/`` implements it; this
    layer sits below it and must not import it (tests/test_purity.py)."""

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the thread; its future."""

    def add_slot(self, slot: EngineSlot) -> None:
        """The thread serves ``slot`` from now on (call on the thread)."""

    def remove_slot(self, slot: EngineSlot, reason: str) -> None:
        """Fail ``slot``'s reads and let its memory go (call on the thread)."""

    def wake(self) -> None:
        """Poll faster now (a first hold); any thread."""

    def take_notices(self, slot: EngineSlot, notices: list[tuple[str, bytes]]) -> None:
        """Notices ``slot``'s data-plane worker received, as (sender agent, bytes): counted like the thread's
        own (any thread)."""



def _still_used(slot: EngineSlot) -> bool:
    """Whether a leaving registration's memory is still in use: holds that may be read, or its own reads in
    flight (here, or in its reader worker: that worker's count). Call with ``slot.lock`` held."""
    return bool(len(slot.holds) or slot.reads or slot.worker_reads_in_flight)


class Registry:
    """The engine slots of one daemon (event-loop side)."""

    def __init__(self, dataplane: SlotThread, publish: Callable[[EngineSlot, HoldEnd], None], *,
                 daemon_id: str, default_lease_s: float, max_lease_s: float, fd_inbox: FdInbox | None = None,
                 max_engines: int = 64, max_registered_bytes: int = 1 << 40, max_holds: int = 100_000,
                 max_hold_s: float = float("inf"), abort_drain_s: float = 30.0,
                 populate_host_memory: bool = True, shm_group: int | None = None,
                 shm_uids: frozenset[int] = frozenset(), workers: WorkerOptions | None = None) -> None:
        """``shm_group``: engine_socket_group, whose members may register too, and ``shm_uids``: allowed_uids,
        who may too (see memory.ShmOpeners); ``workers``: host-memory ranks are served to peers by data-plane
        workers run so (None: by this process, as without dataplane_workers)."""
        self.dataplane = dataplane
        self.workers = workers
        self.shm_group, self.shm_uids = shm_group, shm_uids
        self.populate_host_memory = populate_host_memory  # fault a host cache's pages in at registration
        self.max_holds = max_holds  # per engine rank: sizes its hold board
        self.max_hold_s = max_hold_s  # a hold's whole life, renewals included
        self.abort_drain_s = abort_drain_s  # an aborted read waits that long for transfers UCX cannot stop
        self.max_engines = max_engines
        self.max_registered_bytes = max_registered_bytes
        self.publish = publish
        # Called as a registration closes, before its memory goes (the daemon tells the decode ranks whose
        # pushes this engine will not write now, issue #57).
        self.on_closing: Callable[[EngineSlot], Awaitable[None]] | None = None
        self.daemon_id = daemon_id
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self.retire_s = 0.0  # how long an engine's own Deregister lets its holds run out (the daemon's drain_timeout_s)
        self.fd_inbox = fd_inbox
        # Keep a copy of each shared-memory fd an engine passes, for same-host readers to open (set by the
        # daemon when same-host reads are on: else the received fds close after mapping, as always).
        self.keep_passed_fds = False
        self.slots: dict[str, EngineSlot] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # engine id -> (lock, users)
        self.accepting = True
        self.require_rdma_vram = False  # require_rdma_capable_vram: refuse VRAM a NIC cannot read (engines/gpu.py)
        self._exits: set[asyncio.Task] = set()  # deregistrations of engines whose process exited
        self._retiring: dict[asyncio.Task, EngineSlot] = {}  # engines that deregistered, their holds running out
        self._retire_cut = False  # the daemon is stopping: no more waiting for them (finish_retiring)
        # (slot, event) of a reader worker serving the engine's session, on the loop (the daemon's WorkerSessions)
        self.on_session_event = None
        self._last_sweep_s = time.monotonic()  # maintenance sweeps at least every IDLE_TICK_S from here

    def slot(self, engine_id: str, *, retiring: bool = False) -> EngineSlot:
        """The live registration of ``engine_id`` (for peers: no session involved); ``retiring``: also one that
        deregistered and whose holds are still being read (its readers' probes and renewals)."""
        slot = self.slots.get(engine_id)
        if slot is None or (slot.closing and not (retiring and slot in self._retiring.values())):
            raise NotFoundError("engine_id", f"no engine {engine_id!r} is registered on this daemon")
        return slot

    def session_slot(self, engine_id: str, session: str) -> EngineSlot:
        """The registration of ``engine_id``, for the engine holding its session only."""
        slot = self.slot(engine_id)
        if not hmac.compare_digest(slot.session.encode(), session.encode()):
            raise UnauthenticatedError("engine_id", f"no valid session for engine {engine_id!r}: send the session "
                                                    "its Register returned as kvxferd-session metadata")
        return slot

    def _check_replace(self, engine_id: str, session: str) -> None:
        """A live registration is replaced only by its own session (or once its lease ran out)."""
        old = self.slots.get(engine_id)
        if old is not None and old in self._retiring.values():
            # ALREADY_EXISTS, as for a live registration: a restarting connector waits and retries on it
            raise AlreadyExistsError("engine.engine_id", f"engine {engine_id!r} deregistered and its holds may still "
                                                         "be being read (at most drain_timeout_s): register again then")
        if old is None or old.closing or old.lease_expires_s <= time.monotonic():
            if sum(not s.closing for s in self.slots.values()) >= self.max_engines and old is None:
                raise ResourceExhaustedError("max_engines", f"{self.max_engines} engine ranks are registered already")
            return
        if not (session and hmac.compare_digest(old.session.encode(), session.encode())):
            left_s = old.lease_expires_s - time.monotonic()
            raise AlreadyExistsError("engine.engine_id", f"engine {engine_id!r} is registered and alive; register "
                                                         f"with its session, deregister it, or wait for its lease "
                                                         f"({left_s:.1f} s)")

    @contextlib.asynccontextmanager
    async def _exclusive(self, engine_id: str):
        """One Register/Deregister of ``engine_id`` at a time (the lock lives while anyone uses it)."""
        lock, users = self._locks.get(engine_id, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[engine_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[engine_id]
            if users == 1:
                del self._locks[engine_id]
            else:
                self._locks[engine_id] = (lock, users - 1)

    def check_accepting(self) -> None:
        """New reads and holds are refused once the daemon drains for shutdown."""
        if not self.accepting:
            raise UnavailableError("engine_id", "the daemon is draining for shutdown")

    async def register(self, message: pb.RegisterRequest, session: str = "", *,
                       over_tcp: bool = False) -> EngineSlot:
        """Map, register and publish one engine rank, with a new session.

        A previous registration of the same id is replaced only when
        ``session`` is its session, or its lease ran out; otherwise
        ALREADY_EXISTS. Concurrent calls for one engine id run one after
        another, so each replaced registration is taken down (nothing stays
        mapped). ``over_tcp``: the call came over engine_tcp (anyone with the
        token may have sent it: a shm object named in it must be everyone's).
        """
        if not self.accepting:
            raise UnavailableError("engine", "the daemon is shutting down")
        engine = message.engine
        check_id(engine.engine_id, "engine.engine_id")
        lease_s = check_seconds(message.lease_s, "lease_s", default_s=self.default_lease_s, max_s=self.max_lease_s)
        # Shielded: a caller that gives up mid-way must not leave memory mapped
        # and registered with nobody owning it (the registration then expires).
        for i, reader in enumerate(message.allowed_reader_engine_ids):
            check_id(reader, f"allowed_reader_engine_ids[{i}]")
        openers = ShmOpeners(group=self.shm_group, anyone=over_tcp, uids=self.shm_uids)
        attempt = asyncio.ensure_future(self._register_exclusive(message, lease_s, session, openers))
        attempt.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen even if the caller left
        return await asyncio.shield(attempt)

    async def _register_exclusive(self, message: pb.RegisterRequest, lease_s: float, session: str,
                                  openers: ShmOpeners) -> EngineSlot:
        groups = groups_from_pb(message.engine)  # a malformed message is refused as such, whoever is registered
        async with self._exclusive(message.engine.engine_id):
            self._check_replace(message.engine.engine_id, session)
            return await self._register(message, groups, lease_s, session, openers)

    def _check_bytes(self, engine: pb.EngineRank, groups) -> int:
        """Bytes this registration adds; refused past ``max_registered_bytes`` (a replaced one's bytes count as freed)."""
        num_bytes = 0
        for group_pb, group in zip(engine.groups, groups):
            need = group.spec.region(engine.tp_size or 1, engine.tp_rank).num_bytes
            num_bytes += sum(max(region.num_bytes, need) for region in group_pb.regions)
        old = self.slots.get(engine.engine_id)
        in_use = sum(s.num_bytes for s in self.slots.values() if s is not old)
        if in_use + num_bytes > self.max_registered_bytes:
            raise ResourceExhaustedError("max_registered_bytes", f"{num_bytes} more bytes would exceed the limit of "
                                                                 f"{self.max_registered_bytes} ({in_use} in use)")
        return num_bytes

    async def _register(self, message: pb.RegisterRequest, groups, lease_s: float, session: str,
                        openers: ShmOpeners) -> EngineSlot:
        engine = message.engine
        num_bytes = self._check_bytes(engine, groups)
        fds = self.fd_inbox.take(message.fd_token) if message.fd_token and self.fd_inbox else []
        mapped, process_fd = [], None
        try:
            process_fd = self._process_fd(message, fds)  # checked before any memory is opened
            memory = await asyncio.to_thread(self._open_memory, engine, groups, fds, mapped, openers)
            cache = engine_from_pb(engine, memory)
            old = self.slots.get(cache.engine_id)
            # A session presented while this daemon has no registration of the id (it restarted, or
            # the lease was swept) is kept: the engine's other processes, such as vLLM's scheduler,
            # hold it and go on working. Replacing a live registration always issues a new one.
            kept = session if old is None and _SESSION_FORMAT.fullmatch(session) else ""
            if old is not None:
                log.info("engine re-registered: dropping the old registration", extra={"engine_id": cache.engine_id})
                await self._deregister(old, "engine re-registered")
            incarnation = uuid.uuid4().hex
            slot = await asyncio.to_thread(self._new_slot, cache, incarnation, mapped, lease_s,
                                           asyncio.get_running_loop())
            slot.num_bytes, slot.session = num_bytes, kept or secrets.token_urlsafe(SESSION_BYTES)
            slot.allowed_readers = frozenset(message.allowed_reader_engine_ids)
        except BaseException:
            for mapping in mapped:
                mapping.close()
            if process_fd is not None:
                os.close(process_fd)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        try:
            await asyncio.wrap_future(self.dataplane.call(lambda: self.dataplane.add_slot(slot)))
        except BaseException:  # (a data plane that stopped): nothing of the registration may stay
            if process_fd is not None:
                os.close(process_fd)
            await asyncio.to_thread(self._discard, slot)
            raise
        self.slots[cache.engine_id] = slot
        if process_fd is not None:  # from now on the engine's exit takes the registration down (lifeline.py)
            try:
                slot.process_watch = ProcessWatch(process_fd, asyncio.get_running_loop(),
                                                  lambda: self._process_exited(slot))
            except (OSError, ValueError, KvxferError) as err:  # its lease still ends it: registered all the same
                os.close(process_fd)
                log.warning("cannot watch the engine's process; its lease alone ends the registration",
                            extra={"engine_id": cache.engine_id, "error": str(err)})
        log.info("engine registered", extra={"engine_id": cache.engine_id, "tp": f"{cache.tp_rank}/{cache.tp_size}",
                                             "incarnation": incarnation, "agent": slot.agent.name})
        return slot

    def _open_memory(self, engine: pb.EngineRank, groups, fds, mapped: list, openers: ShmOpeners) -> list[list]:
        """Map every region (in a worker thread: populating a large host cache takes a while)."""
        memory, warning = [], ""
        kept = None
        offers = VmmOffers(self.fd_inbox) if self.keep_passed_fds and self.fd_inbox is not None else None
        if self.keep_passed_fds:  # copies of passed shm fds, for same-host readers; closed with the mappings
            kept = KeptFds()
            mapped.append(kept)
        for g, (group_pb, group) in enumerate(zip(engine.groups, groups)):
            need = group.spec.region(engine.tp_size or 1, engine.tp_rank).num_bytes
            regions = []
            for i, region in enumerate(group_pb.regions):
                field = f"engine.groups[{g}].regions[{i}]"
                num_bytes = region.num_bytes or need
                if num_bytes < need:
                    raise InvalidArgumentError(f"{field}.num_bytes", f"{num_bytes} bytes, the layout needs {need}")
                mapping = open_region(region, num_bytes, engine.mem_type or "DRAM", field, fds, openers, kept,
                                      keep_fd=self.workers is not None,
                                      vmm_offers=offers)
                mapped.append(mapping)
                if isinstance(mapping, GpuMapping):  # what a NIC can make of it: said now, not at a slow read
                    warning = check_servable(mapping, self.require_rdma_vram, field) or warning
                regions.append(mapping.memory)
            memory.append(regions)
        if warning:  # once per registration, with how many regions it is about
            kinds = [m.kind for m in mapped if isinstance(m, GpuMapping) and m.kind != "rdma_capable"]
            log.warning(warning, extra={"engine_id": engine.engine_id, "regions": len(kinds), "kinds": sorted(set(kinds))})
        if self.populate_host_memory:
            start = time.perf_counter()
            try:
                num_bytes = populate(mapped)
            except OSError as err:  # the reads fault their pages in instead
                log.warning("faulting in host memory failed", extra={"engine_id": engine.engine_id, "error": str(err)})
            else:
                log.info("host memory faulted in", extra={"engine_id": engine.engine_id, "num_bytes": num_bytes,
                                                          "duration_s": round(time.perf_counter() - start, 4)})
        return memory

    def _new_slot(self, cache, incarnation: str, mapped: list, lease_s: float,
                  loop: asyncio.AbstractEventLoop | None = None) -> EngineSlot:
        name = f"{self.daemon_id}.{cache.engine_id}.{cache.tp_rank}.{incarnation[:12]}"
        served_here = self.workers is not None and cache.mem_type == "DRAM"
        # Served and read by workers: no NIXL agent in this process (each listens on TCP, and over TCP an
        # agent's process is open to whoever speaks UCX to it); the slot's agent is a name only.
        agent = AgentlessSlot(name) if served_here and self.workers.readers else NixlAgent(name)
        served = executor = holder = None
        try:
            if served_here:
                region_fds = [(m.fd, m.fd_offset, m.array.nbytes) for m in mapped if getattr(m, "fd", -1) >= 0]
                board = BoardMemory.create(buckets_for(self.max_holds))
                try:
                    served = WorkerServed(f"{name}-w", region_fds, board,
                                          lambda notices: self.dataplane.take_notices(slot, notices), self.workers)
                except BaseException:
                    board.close()
                    raise
            reader = None
            if served is not None and self.workers.readers:  # its READs posted by a worker too
                reader = WorkerReadBackend(f"{name}-r", region_fds, cache, served.notices,
                                           poll_interval_s=self.workers.poll_interval_s, wake=self.dataplane.wake,
                                           on_death=self.workers.on_death,
                                           on_lost=lambda: self._reader_lost(slot, loop),
                                           on_replace=self.workers.on_replace)
                if loop is not None and self.on_session_event is not None:
                    on_event = self.on_session_event
                    reader.on_session = lambda message: loop.call_soon_threadsafe(on_event, slot, message)
                reader.begin()  # maps while the holder worker does
                served.reader = reader
            executor = reader if reader is not None else ReadExecutor(agent, cache, served.notices if served else None)
            executor.abort_drain_s = self.abort_drain_s
            holder = Holder(agent, self.max_holds, self.max_hold_s, board_memory=served.board if served else None,
                            board_registered_elsewhere=served is not None)
            slot = EngineSlot(cache, incarnation, agent, executor, mapped, lease_s, 0.0, holder)
            slot.metadata = agent.metadata()  # after registration (cache and board): carries the keys peers need
            if served is not None:
                served.on_generation = lambda up: self._worker_up(slot, up, loop)
                served.start()
                if reader is not None:
                    reader.start()
                slot.served = served
            slot.notices_metadata = executor.notices_metadata()
        except BaseException:
            if holder is not None:
                holder.close()  # its board's registration (and memfd, when its own)
            if served is not None:
                served.close()  # the worker (if it started), its files and the board
            if executor is not None:
                executor.close()
            raise
        slot.heartbeat()
        return slot

    @staticmethod
    def _discard(slot: EngineSlot) -> None:
        """Take apart a slot that never served: its board, worker, NIXL registrations, then its memory (and
        with it any VMM share it offered)."""
        slot.holder.close()
        if slot.served is not None:
            slot.served.close()
        slot.executor.close()
        slot.close_memory()

    @staticmethod
    def _process_fd(message: pb.RegisterRequest, fds: list[int]) -> int | None:
        """The engine's pidfd among the passed fds, checked (None: it passed none)."""
        if not message.HasField("process_fd_index"):
            return None
        index = message.process_fd_index
        if not 0 <= index < len(fds):
            raise InvalidArgumentError("process_fd_index", f"index {index}, {len(fds)} fds were sent")
        process_of(fds[index], "process_fd_index")
        return os.dup(fds[index])  # the passed fds close after registering; the watch keeps this one

    def _process_exited(self, slot: EngineSlot) -> None:
        """The engine's process exited (on the loop): its registration goes now, with every mapping."""
        log.info("engine process exited: deregistering", extra={"engine_id": slot.engine_id,
                                                                "pid": slot.process_watch.pid})
        task = asyncio.ensure_future(self.deregister(slot, "engine process exited"))
        self._exits.add(task)
        task.add_done_callback(self._exits.discard)

    @staticmethod
    def _reader_lost(slot: EngineSlot, loop: asyncio.AbstractEventLoop | None) -> None:
        """The slot's reader worker lost its connections, dying or replaced (supervisor thread): every link
        handshakes again before its next read, with the next generation (not after that read failed)."""
        if loop is not None:
            loop.call_soon_threadsafe(lambda: [setattr(link, "stale", True) for link in slot.links.values()])
        slot.worker_reads_in_flight = 0  # (they went with it: failed whole, or sent again by the engine)

    @staticmethod
    def _worker_up(slot: EngineSlot, up, loop: asyncio.AbstractEventLoop | None) -> None:
        """A new generation of the slot's worker (supervisor thread): holders know this rank's readers by the
        last one's notice agent, so every link handshakes again, introducing the new one."""
        slot.notices_metadata = up.notices_metadata
        if up.generation > 1 and loop is not None:
            loop.call_soon_threadsafe(lambda: [setattr(link, "stale", True) for link in slot.links.values()])

    def num_vram_regions(self, kind: str) -> int:
        """Registered VRAM regions of a kind (:data:`kvxferd.cuda.vmm.MEMORY_KINDS`)."""
        return sum(getattr(m, "kind", None) == kind for slot in list(self.slots.values()) for m in slot.mapped)

    async def deregister(self, slot: EngineSlot, reason: str) -> None:
        """Take a registration down (idempotent)."""
        async with self._exclusive(slot.engine_id):
            await self._deregister(slot, reason)

    async def leave(self, slot: EngineSlot, reason: str) -> None:
        """The engine's own Deregister: the registration takes nothing new, its pushes in flight are aborted
        as before, and its holds, which may be being read, run out (their readers report, or their leases
        end), and so do its own reads in flight (they end as they would have), at most ``retire_s``, before
        its memory goes. Answered once the memory went, or at once while holds or reads run out (in the
        background: a connector's Deregister has a short deadline). The work runs in a task of its own: a
        caller that stops waiting does not stop it."""
        if slot.closing:
            return
        slot.closing = True  # no new holds, reads or handshakes; the data plane still serves and polls it
        with slot.lock:
            used = _still_used(slot)
        task = asyncio.ensure_future(self._retire(slot, reason))
        self._retiring[task] = slot
        task.add_done_callback(lambda done: self._retiring.pop(done, None))
        if not used:
            await asyncio.shield(task)

    @property
    def num_retiring(self) -> int:
        """Registrations that left and whose holds are still running out."""
        return len(self._retiring)

    async def finish_retiring(self) -> None:
        """Stop waiting for leaving engines' holds and take them down now (the daemon is stopping)."""
        self._retire_cut = True
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _retire(self, slot: EngineSlot, reason: str) -> None:
        try:
            if self.on_closing is not None:
                await self.on_closing(slot)
            await self._let_holds_and_reads_end(slot)
        except Exception:  # (taken down all the same: a slot left closing would keep its memory for good)
            log.exception("letting a deregistered engine's holds end failed", extra={"engine_id": slot.engine_id})
        async with self._exclusive(slot.engine_id):
            await self._deregister(slot, reason, retiring=True)

    async def _let_holds_and_reads_end(self, slot: EngineSlot) -> None:
        """Wait while ``slot`` holds blocks or reads, at most ``retire_s``. A READ that a holder's UCX serves
        cannot be stopped, and over TCP it is served from the memory _deregister unmaps: the daemon died of it
        (SIGSEGV, tests/rig/verify/hosts/test_shutdown_order.py). A hold ends when its readers report (their
        notices reach the data plane, which polls the slot until it is removed) or when its lease ends. On
        the reading side, a READ aborted mid-transfer and its agent closed killed the *holder's* daemon
        (SIGSEGV in UCX's progress over TCP's emulated RMA, about one run in ten of that test): the reads run
        out first (their deadlines bound them), writing into the memory this daemon still maps."""
        deadline_s = time.monotonic() + self.retire_s
        while time.monotonic() < deadline_s and not self._retire_cut:
            with slot.lock:
                ended = slot.holds.expire(time.monotonic())
                used = _still_used(slot)
            for end in ended:
                self.publish(slot, end)
            if not used:
                return
            await asyncio.sleep(RETIRE_POLL_S)

    async def _deregister(self, slot: EngineSlot, reason: str, *, retiring: bool = False) -> None:
        if slot.closing and not retiring:
            return
        slot.closing = True
        if slot.process_watch is not None:
            slot.process_watch.close()
        with slot.lock:
            ended = slot.holds.drop_all(reason)
        for end in ended:
            self.publish(slot, end)
        if self.on_closing is not None and not retiring:  # (a retiring one's ran when it began)
            await self.on_closing(slot)
        try:
            await asyncio.wrap_future(self.dataplane.call(lambda: self.dataplane.remove_slot(slot, reason)))
        except KvxferError as err:
            log.error("deregistering NIXL memory failed", extra={"engine_id": slot.engine_id, "error": str(err)})
        if slot.served is not None:  # its worker's registrations go with it, then the board
            await asyncio.to_thread(slot.served.close)
        slot.close_memory()
        if self.slots.get(slot.engine_id) is slot:
            del self.slots[slot.engine_id]
        slot.completions.close()
        collect_agents()  # the slot's NIXL agent goes now, not at some later collection
        log.info("engine deregistered", extra={"engine_id": slot.engine_id, "reason": reason})

    async def expire(self, stalled_s: float = 0.0) -> None:
        """Deregister engines whose heartbeats stopped; expire held leases.

        ``stalled_s``: how much later than due this sweep runs (the daemon did
        not run meanwhile). A registration's lease counts only time in which
        the daemon could hear heartbeats: every lease is pushed back by a
        stall, and after a stretch longer than ``PAUSE_S`` every registration
        counts its lease from now, as if a heartbeat had just come. Without
        it, a daemon frozen for about a lease dropped every engine on
        resuming, before it read the heartbeats waiting on its socket (the
        soak, seed 23: a 1.5 s stop against a 2 s lease). Holds keep their
        leases: their blocks stay held until they end, either way.
        """
        now = time.monotonic()
        gap_s = now - self._last_sweep_s
        self._last_sweep_s = now
        if gap_s > PAUSE_S:
            log.warning("this daemon did not run for a while (stopped, paused or starved); engine "
                        "registrations count their leases from now", extra={"gap_s": round(gap_s, 3)})
            for slot in self.slots.values():
                slot.lease_expires_s = max(slot.lease_expires_s, now + slot.lease_s)
        elif stalled_s > 0:
            for slot in self.slots.values():
                slot.lease_expires_s += stalled_s
        for slot in list(self.slots.values()):
            if slot.closing:
                continue
            if slot.lease_expires_s <= now:
                await self.deregister(slot, "engine gone (no heartbeat)")
                continue
            with slot.lock:  # bounded: a burst of expiries spreads over ticks instead of stalling the loop
                ended = slot.holds.expire(now, max_ends=MAX_EXPIRIES_PER_TICK)
            for end in ended:
                self.publish(slot, end)

    def check_trust(self, now_s: float) -> None:
        """Replace the worker of each rank whose metadata went to a certificate that expires soon (wall-clock
        ``now_s``): the replacement, its start and the old one's grace fit before it (TRUST_LEAD_S)."""
        if self.workers is None:
            return
        lead_s = self.trust_lead_s
        for slot in list(self.slots.values()):
            served = slot.served
            if served is not None and served.handed.due(served.generation, now_s, lead_s):
                served.replace(CERTIFICATE_EXPIRES)

    @property
    def trust_lead_s(self) -> float:
        """How long before a certificate expires the workers its metadata went to are replaced (and from when
        on it is handed no metadata): the grace, the least interval between replacements, TRUST_LEAD_S."""
        return 0.0 if self.workers is None else (self.workers.retire_grace_s + self.workers.replace_interval_s
                                                  + TRUST_LEAD_S)

    def replace_workers(self, reason: str) -> None:
        """Replace every rank's workers (any thread): trust ended in whomever their metadata went to, and
        in the holders its reader worker connected to (they learned that worker's address)."""
        for slot in list(self.slots.values()):
            if slot.served is not None:
                slot.served.replace(reason)
                if slot.served.reader is not None:
                    slot.served.reader.replace(reason)

    def num_workers_given_up(self) -> int:
        """Engine ranks whose data-plane worker is not started again (a generation could not map, or broke
        the protocol before it was up: the next would do the same). One that keeps dying is started again
        after a growing pause instead."""
        return sum(1 for slot in list(self.slots.values()) if slot.served is not None and slot.served.failure)

    def num_holds(self) -> int:
        return sum(len(s.holds) for s in self.slots.values())

    def num_expectations(self) -> int:
        """Push, prefill side: decode ranks' expectations kept (waiting for their hold, or being written)."""
        return sum(sum(list(s.num_expectations_by_owner.values())) for s in list(self.slots.values()))
