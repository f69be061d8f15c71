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
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError, UnavailableError
from kvxferd.plan.leases import HoldEnd
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.dataplane import DataPlane
from kvxferd.service.fdpass import FdInbox
from kvxferd.service.memory import open_region
from kvxferd.service.slots import EngineSlot
from kvxferd.service.wire import check_id, check_seconds, engine_from_pb, groups_from_pb
from kvxferd.xfer.agent import NixlAgent
from kvxferd.xfer.reads import ReadExecutor

log = logging.getLogger("kvxferd.engines")


class Registry:
    """The engine slots of one daemon (event-loop side)."""

    def __init__(self, dataplane: DataPlane, publish: Callable[[EngineSlot, str, HoldEnd], None], *,
                 daemon_id: str, default_lease_s: float, max_lease_s: float, fd_inbox: FdInbox | None = None) -> None:
        self.dataplane = dataplane
        self.publish = publish
        self.daemon_id = daemon_id
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self.fd_inbox = fd_inbox
        self.slots: dict[str, EngineSlot] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # engine id -> (lock, users)
        self.accepting = True

    def slot(self, engine_id: str) -> EngineSlot:
        """The live registration of ``engine_id``."""
        slot = self.slots.get(engine_id)
        if slot is None or slot.closing:
            raise NotFoundError("engine_id", f"no engine {engine_id!r} is registered on this daemon")
        return slot

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

    async def register(self, message: pb.RegisterRequest) -> EngineSlot:
        """Map, register and publish one engine rank; replaces a previous registration of the same id.

        Concurrent calls for one engine id run one after another, so each
        replaced registration is taken down (nothing stays mapped).
        """
        if not self.accepting:
            raise UnavailableError("engine", "the daemon is shutting down")
        engine = message.engine
        check_id(engine.engine_id, "engine.engine_id")
        lease_s = check_seconds(message.lease_s, "lease_s", default_s=self.default_lease_s, max_s=self.max_lease_s)
        # Shielded: a caller that gives up mid-way must not leave memory mapped
        # and registered with nobody owning it (the registration then expires).
        attempt = asyncio.ensure_future(self._register_exclusive(message, lease_s))
        attempt.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen even if the caller left
        return await asyncio.shield(attempt)

    async def _register_exclusive(self, message: pb.RegisterRequest, lease_s: float) -> EngineSlot:
        async with self._exclusive(message.engine.engine_id):
            return await self._register(message, lease_s)

    async def _register(self, message: pb.RegisterRequest, lease_s: float) -> EngineSlot:
        engine = message.engine
        groups = groups_from_pb(engine)
        fds = self.fd_inbox.take(message.fd_token) if message.fd_token and self.fd_inbox else []
        mapped = []
        try:
            memory = await asyncio.to_thread(self._open_memory, engine, groups, fds, mapped)
            cache = engine_from_pb(engine, memory)
            old = self.slots.get(cache.engine_id)
            if old is not None:
                log.info("engine re-registered: dropping the old registration", extra={"engine_id": cache.engine_id})
                await self._deregister(old, "engine re-registered")
            incarnation = uuid.uuid4().hex
            slot = await asyncio.to_thread(self._new_slot, cache, incarnation, mapped, lease_s)
        except BaseException:
            for mapping in mapped:
                mapping.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        await asyncio.wrap_future(self.dataplane.call(lambda: self.dataplane.add_slot(slot)))
        self.slots[cache.engine_id] = slot
        log.info("engine registered", extra={"engine_id": cache.engine_id, "tp": f"{cache.tp_rank}/{cache.tp_size}",
                                             "incarnation": incarnation, "agent": slot.agent.name})
        return slot

    @staticmethod
    def _open_memory(engine: pb.EngineRank, groups, fds, mapped: list) -> list[list]:
        memory = []
        for g, (group_pb, group) in enumerate(zip(engine.groups, groups)):
            need = group.spec.region(engine.tp_size or 1, engine.tp_rank).num_bytes
            regions = []
            for i, region in enumerate(group_pb.regions):
                field = f"engine.groups[{g}].regions[{i}]"
                num_bytes = region.num_bytes or need
                if num_bytes < need:
                    raise InvalidArgumentError(f"{field}.num_bytes", f"{num_bytes} bytes, the layout needs {need}")
                mapping = open_region(region, num_bytes, engine.mem_type or "DRAM", field, fds)
                mapped.append(mapping)
                regions.append(mapping.memory)
            memory.append(regions)
        return memory

    def _new_slot(self, cache, incarnation: str, mapped: list, lease_s: float) -> EngineSlot:
        name = f"{self.daemon_id}.{cache.engine_id}.{cache.tp_rank}.{incarnation[:12]}"
        agent = NixlAgent(name)
        executor = ReadExecutor(agent, cache)
        slot = EngineSlot(cache, incarnation, agent, executor, mapped, lease_s, 0.0)
        slot.metadata = agent.metadata()  # after registration: carries the memory keys peers need
        slot.heartbeat()
        return slot

    async def deregister(self, slot: EngineSlot, reason: str) -> None:
        """Take a registration down (idempotent)."""
        async with self._exclusive(slot.engine_id):
            await self._deregister(slot, reason)

    async def _deregister(self, slot: EngineSlot, reason: str) -> None:
        if slot.closing:
            return
        slot.closing = True
        with slot.lock:
            ended = slot.holds.drop_all(reason)
        for end in ended:
            self.publish(slot, end.kind, end)
        try:
            await asyncio.wrap_future(self.dataplane.call(lambda: self.dataplane.remove_slot(slot, reason)))
        except KvxferError as err:
            log.error("deregistering NIXL memory failed", extra={"engine_id": slot.engine_id, "error": str(err)})
        slot.close_memory()
        if self.slots.get(slot.engine_id) is slot:
            del self.slots[slot.engine_id]
        slot.completions.close()
        log.info("engine deregistered", extra={"engine_id": slot.engine_id, "reason": reason})

    async def expire(self) -> None:
        """Deregister engines whose heartbeats stopped; expire held leases."""
        now = time.monotonic()
        for slot in list(self.slots.values()):
            if slot.closing:
                continue
            if slot.lease_expires_s <= now:
                await self.deregister(slot, "engine gone (no heartbeat)")
                continue
            with slot.lock:
                ended = slot.holds.expire(now)
            for end in ended:
                self.publish(slot, end.kind, end)

    def num_holds(self) -> int:
        return sum(len(s.holds) for s in self.slots.values())
