"""The gRPC services: EngineService (engine <-> its daemon), PeerService (daemon <-> daemon).

Handlers validate input (``wire``), call into the daemon's parts and map
every typed error to a status in one place (:func:`kvxferd.service.status.status_code`).
Nothing here blocks the event loop on NIXL: reads are planned here
(vectorised, microseconds) and posted by the data-plane thread.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np

from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError, UnavailableError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxferd.service.dataplane import DaemonRead
from kvxferd.service.completions import StreamReplaced
from kvxferd.service.peerinfo import PROTOCOL_VERSION, encode_info
from kvxferd.service.slots import ActiveRead
from kvxferd.service.status import status_code
from kvxferd.service.wire import check_id, check_peer_addresses, check_seconds, ids_from_pb, read_request_from_pb

if TYPE_CHECKING:
    from kvxferd.service.daemon import Daemon

log = logging.getLogger("kvxferd.rpc")


def rpc(fn):
    """Typed errors -> their status; anything else -> INTERNAL, logged."""
    name = fn.__name__

    @functools.wraps(fn)
    async def handler(self, request, context):
        try:
            return await fn(self, request, context)
        except KvxferError as err:
            code, message = status_code(err), str(err)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as err:  # a bug: keep serving, tell the caller
            log.exception("internal error", extra={"method": name})
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"
        self.daemon.metrics.rpc_errors.labels(name, code.name).inc()
        await context.abort(code, message)

    return handler


def _check_block_ids(lists, slot, field: str) -> tuple[np.ndarray, ...]:
    groups = slot.cache.groups
    if len(lists) != len(groups):
        raise InvalidArgumentError(field, f"{len(lists)} groups given, engine has {len(groups)}")
    out = ids_from_pb(lists)
    for g, (ids, group) in enumerate(zip(out, groups)):
        if len(ids) and (ids.min() < 0 or ids.max() >= group.spec.num_blocks):
            raise InvalidArgumentError(f"{field}[{g}]", f"block ids must lie in [0, {group.spec.num_blocks})")
    return out


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, daemon: "Daemon") -> None:
        self.daemon = daemon

    @rpc
    async def Register(self, request, context):
        slot = await self.daemon.registry.register(request)
        return pb.RegisterReply(incarnation=slot.incarnation, notify_address=self.daemon.bus.address,
                                notify_last_seq=self.daemon.bus.last_seq(slot.engine_id),
                                peer_address=self.daemon.addresses.get("peer", ""))

    @rpc
    async def Heartbeat(self, request, context):
        self.daemon.registry.slot(request.engine_id).heartbeat()
        return pb.HeartbeatReply()

    @rpc
    async def Deregister(self, request, context):
        await self.daemon.registry.deregister(self.daemon.registry.slot(request.engine_id), "engine deregistered")
        return pb.DeregisterReply()

    @rpc
    async def Handshake(self, request, context):
        slot = self.daemon.registry.slot(request.engine_id)
        check_id(request.remote_engine_id, "remote_engine_id")
        check_peer_addresses(request.peer_addresses)
        start = time.perf_counter()
        await self.daemon.peers.handshake(slot, request.remote_engine_id, tuple(request.peer_addresses))
        return pb.HandshakeReply(remote_tp_size=len(request.peer_addresses), duration_s=time.perf_counter() - start)

    @rpc
    async def SubmitRead(self, request, context):
        received_s = time.perf_counter()
        daemon = self.daemon
        if not daemon.registry.accepting:
            raise UnavailableError("engine_id", "the daemon is draining for shutdown")
        slot = daemon.registry.slot(request.engine_id)
        read = read_request_from_pb(request)
        if read.request_id in slot.active:
            raise InvalidArgumentError("request_id", f"request {read.request_id!r} is already in flight")
        link = slot.links.get(request.remote_engine_id)
        if link is None or link.remote is None:
            raise NotFoundError("remote_engine_id", f"no handshake with {request.remote_engine_id!r} yet")
        config = daemon.config
        deadline_s = received_s + check_seconds(request.deadline_s, "deadline_s", default_s=config.deadline_s,
                                                max_s=config.max_deadline_s)
        planned = link.remote.plan.plan_request(read)  # bad ids fail here, before anything is posted
        slot.active[read.request_id] = ActiveRead(request.remote_engine_id, read.remote_request_id, time.monotonic())
        daemon_read = DaemonRead(slot, link.remote, planned, received_s, deadline_s)
        if link.ready:
            daemon.dataplane.submit(daemon_read)
        else:  # re-handshake first (the remote restarted or failed); the engine is not kept waiting
            daemon.spawn(daemon.submit_after_handshake(daemon_read, link))
        return pb.SubmitReadReply()

    async def WatchCompletions(self, request, context):
        try:
            slot = self.daemon.registry.slot(request.engine_id)
        except KvxferError as err:
            await context.abort(status_code(err), str(err))
        try:
            async for completion in slot.completions.stream():
                yield completion
        except StreamReplaced as err:
            await context.abort(grpc.StatusCode.ABORTED, f"engine_id: {err}")

    @rpc
    async def Hold(self, request, context):
        if not self.daemon.registry.accepting:
            raise UnavailableError("engine_id", "the daemon is draining for shutdown")
        slot = self.daemon.registry.slot(request.engine_id)
        check_id(request.request_id, "request_id")
        block_ids = _check_block_ids(request.block_ids, slot, "block_ids")
        lease_s = _lease_s(self.daemon, request.lease_s)
        with slot.lock:
            slot.holds.hold(request.request_id, tuple(block_ids), lease_s, time.monotonic())
        return pb.HoldReply()

    @rpc
    async def RenewLease(self, request, context):
        return _renew(self.daemon, request)

    @rpc
    async def Release(self, request, context):
        slot = self.daemon.registry.slot(request.engine_id)
        with slot.lock:
            end = slot.holds.release(request.request_id)
        self.daemon.publish(slot, end.kind, end)
        return pb.ReleaseReply()

    @rpc
    async def MissedEvents(self, request, context):
        check_id(request.engine_id, "engine_id")
        return self.daemon.bus.missed(request.engine_id, request.after_seq)


def _lease_s(daemon: "Daemon", value: float) -> float:
    return check_seconds(value, "lease_s", default_s=daemon.config.lease_s, max_s=daemon.config.max_lease_s)


def _renew(daemon: "Daemon", request: pb.RenewLeaseRequest) -> pb.RenewLeaseReply:
    slot = daemon.registry.slot(request.engine_id)
    lease_s = _lease_s(daemon, request.lease_s)
    with slot.lock:
        unknown = slot.holds.renew(request.request_ids, lease_s, time.monotonic())
    return pb.RenewLeaseReply(unknown_request_ids=unknown)


class PeerServicer(pb_grpc.PeerServiceServicer):
    def __init__(self, daemon: "Daemon") -> None:
        self.daemon = daemon

    @rpc
    async def GetEngineInfo(self, request, context):
        if request.protocol_version != PROTOCOL_VERSION:
            raise UnavailableError("protocol_version", f"caller speaks v{request.protocol_version}, this daemon v{PROTOCOL_VERSION}")
        slot = self.daemon.registry.slot(request.engine_id)
        if request.tp_rank != slot.cache.tp_rank:
            raise InvalidArgumentError("tp_rank", f"this daemon serves rank {slot.cache.tp_rank} of "
                                                  f"{request.engine_id!r}, not {request.tp_rank}")
        if request.reader_agent_metadata:  # so this side can acknowledge the reader's notices
            await self._introduce(slot, request)
        return encode_info(slot.incarnation, slot.metadata, slot.cache)

    async def _introduce(self, slot, request: pb.EngineInfoRequest) -> None:
        """Load the reader's agent; one reference per (reader engine, rank), the previous one dropped.

        A bad introduction fails here without touching any agent already
        loaded: :meth:`NixlAgent.add_remote` refuses a known name with other
        bytes, and an agent shared by several introductions stays loaded
        until the last one lets go.
        """
        check_id(request.reader_engine_id, "reader_engine_id")
        if request.reader_tp_rank < 0:
            raise InvalidArgumentError("reader_tp_rank", f"must not be negative, got {request.reader_tp_rank}")
        reader = (request.reader_engine_id, request.reader_tp_rank)
        async with slot.introductions:
            name = await self.daemon.run_blocking(slot.agent.add_remote, request.reader_agent_metadata,
                                                  "reader_agent_metadata")
            old = slot.readers.get(reader)
            slot.readers[reader] = name
            if old is not None:  # the same reader again, or restarted under a new agent
                await self.daemon.run_blocking(slot.agent.remove_remote, old)

    @rpc
    async def GetIncarnation(self, request, context):
        return pb.IncarnationReply(incarnation=self.daemon.registry.slot(request.engine_id).incarnation)

    @rpc
    async def RenewLeases(self, request, context):
        return _renew(self.daemon, request)
