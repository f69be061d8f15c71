"""The gRPC services: EngineService (engine <-> its daemon), PeerService (daemon <-> daemon).

Handlers validate input (``wire``), call into the daemon's parts and map
every typed error to a status in one place (:func:`kvxferd.service.base.status.status_code`).

Who may call what::

    EngineService  Register: anyone who can open the engine socket (its mode decides;
                             over engine_tcp also the bearer token)
                   the rest: the engine's session from Register ("kvxferd-session" metadata)
    PeerService    with TLS: a client certificate whose identity is on peer_allowed_ids
                   GetEngineInfo also requires the reader to introduce itself
Nothing here blocks the event loop on NIXL: reads are planned here
(vectorised, microseconds) and posted by the data-plane thread.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from typing import TYPE_CHECKING

import grpc

from kvxferd.errors import (InvalidArgumentError, PermissionDeniedError, UnauthenticatedError,
                            UnavailableError)
from kvxferd.plan.engine import notifying_readers
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.service.base import audit
from kvxferd.wire.frames import COMPLETIONS_PER_BATCH
from kvxferd.service.engines.holding import final_layers, place_hold, release_hold, renew_holds
from kvxferd.service.base.status import error_status
from kvxferd.service.peers.proof import ChallengeSigner
from kvxferd.service.peers.tls import authorize_peer
from kvxferd.service.workers.trust import INTRODUCTION_ENDED, peer_certificate_expiry_s
from kvxferd.wire.challenge import CHALLENGE_KEY, NONCE_BYTES, ChallengeBook, Nonces, secret_proof
from kvxferd.wire.messages import MAX_TP_SIZE, check_id, check_peer_addresses
from kvxferd.wire.names import SESSION_KEY
from kvxferd.wire.peerauth import PEER_TOKEN_KEY, check_peer_call
from kvxferd.wire.samehost import holder_proof, is_same_host
from kvxferd.wire.peerinfo import PROTOCOL_VERSION, encode_info
from kvxferd.xfer.nixl.agent import agent_name_of
from kvxferd.xfer.holder import Reader, ReaderLimits
from kvxferd.xfer.readers import Introduced

if TYPE_CHECKING:
    from kvxferd.service.net.parts import DaemonParts


def rpc(fn):
    """Typed errors -> their status; anything else -> INTERNAL with an error id (details only in the log)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def handler(self, request, context):
        try:
            reply = await fn(self, request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as err:
            code, message = error_status(name, err)
        else:
            self.audit(name, request, context, grpc.StatusCode.OK)
            return reply
        self.daemon.metrics.rpc_errors.labels(name, code.name).inc()
        self.audit(name, request, context, code, message)
        await context.abort(code, message)

    return handler


def metadata_value(context, key: str) -> str:
    """One gRPC metadata value sent by the caller ("" when absent)."""
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value
    return ""


class EngineServicer(engine_grpc.EngineServiceServicer):
    def __init__(self, daemon: "DaemonParts") -> None:
        self.daemon = daemon

    def audit(self, method: str, request, context, code: grpc.StatusCode, error: str = "") -> None:
        """Only refusals of security meaning (a session, a token, an object the caller may not name) get a line,
        rate-limited: :func:`kvxferd.service.base.audit.engine_call`. The rest is the engine's own business."""
        audit.engine_call(method, request, context, code, error)

    def _check_transport(self, context) -> None:
        """Over engine_tcp (not the UNIX socket) the caller must present the bearer token."""
        token = self.daemon.engine_token
        if context.peer().startswith("unix:") or token is None:
            return
        presented = metadata_value(context, "authorization").removeprefix("Bearer ")
        if not hmac.compare_digest(presented.encode(), token.encode()):
            raise UnauthenticatedError("authorization", "engine_tcp needs the bearer token (authorization metadata)")

    def _slot(self, engine_id: str, context):
        """The caller's own registration: its session must come with the call."""
        self._check_transport(context)
        return self.daemon.registry.session_slot(engine_id, metadata_value(context, SESSION_KEY))

    @rpc
    async def Register(self, request, context):
        self._check_transport(context)
        slot = await self.daemon.registry.register(request, metadata_value(context, SESSION_KEY),
                                                   over_tcp=not context.peer().startswith("unix:"))
        return pb.RegisterReply(incarnation=slot.incarnation, notify_address=self.daemon.bus.address,
                                notify_last_seq=self.daemon.bus.last_seq(slot.engine_id),
                                peer_address=self.daemon.addresses.get("peer", ""), session=slot.session,
                                notify_curve_server_key=self.daemon.bus.curve_public_key)

    @rpc
    async def Heartbeat(self, request, context):
        self._slot(request.engine_id, context).heartbeat()
        return pb.HeartbeatReply()

    @rpc
    async def Deregister(self, request, context):
        await self.daemon.registry.leave(self._slot(request.engine_id, context), "engine deregistered")
        return pb.DeregisterReply()

    @rpc
    async def Handshake(self, request, context):
        slot = self._slot(request.engine_id, context)
        check_id(request.remote_engine_id, "remote_engine_id")
        check_peer_addresses(request.peer_addresses)
        start = time.perf_counter()
        await self.daemon.peers.handshake(slot, request.remote_engine_id, tuple(request.peer_addresses))
        return pb.HandshakeReply(remote_tp_size=len(request.peer_addresses), duration_s=time.perf_counter() - start)

    async def Reads(self, request_iterator, context):
        """Batches of reads in, batches of completions out, on one stream per engine session.

        This generator is the only writer of the call; a task reads the
        engine's batches and, when it fails, wakes the generator, which ends
        the stream with that error's status.
        """
        receiver = first = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None:
                return
            slot = self._slot(first.engine_id, context)
            receiver = asyncio.ensure_future(self._receive_reads(slot, first, request_iterator))
            receiver.add_done_callback(lambda _: slot.completions.poke())
            failed = lambda: receiver.done() and not receiver.cancelled() and receiver.exception() is not None
            async for batch in slot.completions.batches(COMPLETIONS_PER_BATCH, failed):
                yield pb.CompletionBatch(completions=batch)
            if failed():
                receiver.result()  # raises: the stream ends with its status
            # The registration ended (deregistered, expired, daemon draining): everything queued was
            # sent; an error, not OK, so the engine knows no more completions will come on this session.
            raise UnavailableError("engine_id", f"the registration of {slot.engine_id!r} ended")
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as err:
            code, message = error_status("Reads", err)
        finally:
            if receiver is not None:
                receiver.cancel()
        self.daemon.metrics.rpc_errors.labels("Reads", code.name).inc()
        self.audit("Reads", first, context, code, message)
        await context.abort(code, message)

    async def _receive_reads(self, slot, first, request_iterator) -> None:
        batch = first
        while batch is not None:
            self.daemon.reads.take_batch(slot, batch, time.perf_counter())
            batch = await anext(request_iterator, None)
        # The engine half-closed: it submits nothing more; completions keep flowing until it cancels.

    @rpc
    async def Hold(self, request, context):
        slot = self._slot(request.engine_id, context)
        capability, digests = place_hold(self.daemon, slot, request)
        return pb.HoldReply(incarnation=slot.incarnation, capability=capability, digests=digests)

    @rpc
    async def FinalLayers(self, request, context):
        return pb.FinalLayersReply(final=final_layers(self.daemon, self._slot(request.engine_id, context), request))

    @rpc
    async def RenewLease(self, request, context):
        return pb.RenewLeaseReply(unknown_request_ids=renew_holds(self.daemon, self._slot(request.engine_id, context),
                                                                  request))

    @rpc
    async def Release(self, request, context):
        release_hold(self.daemon, self._slot(request.engine_id, context), request.request_id)
        return pb.ReleaseReply()

    @rpc
    async def MissedEvents(self, request, context):
        check_id(request.engine_id, "engine_id")
        self._slot(request.engine_id, context)
        return self.daemon.bus.missed(request.engine_id, request.after_seq)


class PeerServicer(peer_grpc.PeerServiceServicer):
    def __init__(self, daemon: "DaemonParts") -> None:
        self.daemon = daemon
        self.challenges = ChallengeBook()  # server nonces issued, each good for one call (kvxferd.wire.challenge)
        self.signer = ChallengeSigner(daemon.tls) if daemon.tls is not None else None

    def audit(self, method: str, request, context, code: grpc.StatusCode, error: str = "") -> None:
        """One ``kvxferd.audit`` line per decision about a peer (introductions, renewals), refusals rate-limited
        per caller: :func:`kvxferd.service.base.audit.peer_call`."""
        audit.peer_call(method, request, context, code, error)

    def _authorize(self, context) -> tuple[str, Nonces | None]:
        """Before anything is looked up: ``(identity, nonces)`` of the caller. With TLS, its certificate identity
        must be on the allow-list (the nonces of a challenge, used up here, come along where the call names
        one: a same-host token is bound to them); without, the call must follow a challenge issued here and
        carry its token (kvxferd.wire.peerauth; identity "": every daemon of the host is one identity)."""
        challenge = metadata_value(context, CHALLENGE_KEY)
        if self.daemon.config.tls:
            identity = authorize_peer(context, tuple(self.daemon.config.peer_allowed_ids))
            nonces = None
            if challenge:
                nonces = Nonces.parse(challenge)
                self.challenges.take(nonces)
            return identity, nonces
        secret = self.daemon.peers.secret  # this host's peer secret, loaded at start (kvxferd.wire.peerauth)
        if secret is None:
            raise UnauthenticatedError("peer", "this daemon is still starting")
        return "", check_peer_call(secret, self.daemon.peer_token_address, self.challenges, challenge,
                                   metadata_value(context, PEER_TOKEN_KEY))

    @rpc
    async def Challenge(self, request, context):
        """A server nonce and this daemon's proof over both nonces (kvxferd.wire.challenge). With TLS only an
        allowed peer gets a signature, so a foreign server cannot relay a reader's challenge to us."""
        if self.daemon.config.tls:
            authorize_peer(context, tuple(self.daemon.config.peer_allowed_ids))
        if request.protocol_version != PROTOCOL_VERSION:
            raise UnavailableError("protocol_version", f"caller speaks v{request.protocol_version}, this daemon "
                                                       f"v{PROTOCOL_VERSION}")
        if len(request.client_nonce) != NONCE_BYTES:
            raise InvalidArgumentError("client_nonce", f"must be {NONCE_BYTES} bytes, got {len(request.client_nonce)}")
        secret = self.daemon.peers.secret
        if self.signer is None and secret is None:
            raise UnauthenticatedError("peer", "this daemon is still starting")
        nonces = self.challenges.issue(request.client_nonce)
        if self.signer is not None:
            signature, certificate = self.signer.sign(nonces)
            return pb.ChallengeReply(protocol_version=PROTOCOL_VERSION, server_nonce=nonces.server, proof=signature,
                                     certificate=certificate)
        return pb.ChallengeReply(protocol_version=PROTOCOL_VERSION, server_nonce=nonces.server,
                                 proof=secret_proof(secret, self.daemon.peer_token_address, nonces))

    @rpc
    async def GetEngineInfo(self, request, context):
        identity, nonces = self._authorize(context)
        if request.protocol_version != PROTOCOL_VERSION:
            raise UnavailableError("protocol_version", f"caller speaks v{request.protocol_version}, this daemon v{PROTOCOL_VERSION}")
        slot = self.daemon.registry.slot(request.engine_id)
        if request.tp_rank != slot.cache.tp_rank:
            raise InvalidArgumentError("tp_rank", f"this daemon serves rank {slot.cache.tp_rank} of "
                                                  f"{request.engine_id!r}, not {request.tp_rank}")
        expiry_s = peer_certificate_expiry_s(context)  # refused before it is introduced: it takes no place
        if slot.served is not None and expiry_s - time.time() < self.daemon.registry.trust_lead_s:
            raise UnavailableError("peer", f"the caller's certificate expires in {expiry_s - time.time():.0f} s: "
                                           f"a data-plane worker's metadata goes only to certificates valid for "
                                           f"{self.daemon.registry.trust_lead_s:.0f} s more (renew it)")
        target = self.daemon.writes.check_target(slot, request)  # push (issue #57): the reader's own rank only
        await self._introduce(slot, request, identity)  # no agent metadata or addresses for anyone who does not
        # A reader on this host (proved: kvxferd.wire.samehost) gets the names of the engine's shared memory.
        secret, address = self.daemon.peers.same_host_secret, self.daemon.peer_token_address
        same_host = secret is not None and is_same_host(secret, address, nonces, request.same_host_token)
        if target is not None:  # the writer connects to the reader's rank now, as this identity's target
            self.daemon.writes.connect_target(slot, target, identity, same_host=same_host)
        proof = holder_proof(secret, address, request.same_host_token) if same_host else ""
        incarnation, metadata, cache, board = slot.peer_view(expiry_s)
        return encode_info(incarnation, metadata, cache, board, same_host_proof=proof,
                           writer_agent_name=slot.writer_agent_name if self.daemon.config.push_targets else "")

    async def _introduce(self, slot, request: pb.EngineInfoRequest, identity: str, peer: str = "") -> None:
        """Record which NIXL agent this reader's notices come from, by the name its metadata carries.

        Nothing is loaded: the holder sends readers nothing (they check their
        holds on its board), so it needs only the name to count the reader's
        notices and drop everyone else's. Readers are kept per peer identity
        (kvxferd.xfer.readers): another allowed identity naming the same reader
        gets an entry of its own, so it can neither hold the reader's owner out
        nor take over its notices. The same identity naming another agent for
        a reader it introduced replaces the old one (a restarted reader), with
        an audit line. Each identity may have ``max_readers_per_identity``
        readers; a reader idle for ``reader_idle_s`` gives up its place to a new one.
        """
        check_id(request.reader_engine_id, "reader_engine_id")
        if not request.reader_agent_metadata:
            raise InvalidArgumentError("reader_agent_metadata", "a reader must introduce its NIXL agent")
        if not 1 <= request.reader_tp_size <= MAX_TP_SIZE:
            raise InvalidArgumentError("reader_tp_size", f"must lie in [1, {MAX_TP_SIZE}], got {request.reader_tp_size}")
        if not 0 <= request.reader_tp_rank < request.reader_tp_size:
            raise InvalidArgumentError("reader_tp_rank", f"rank {request.reader_tp_rank} of reader TP size "
                                                         f"{request.reader_tp_size} cannot exist")
        if slot.allowed_readers and request.reader_engine_id not in slot.allowed_readers:
            raise PermissionDeniedError("reader_engine_id", f"engine {slot.engine_id!r} does not allow "
                                                            f"{request.reader_engine_id!r} to read it")
        notifying = notifying_readers(slot.cache, request.reader_tp_size)  # raises for an impossible TP pairing
        expected = int(notifying.sum())
        name = agent_name_of(request.reader_agent_metadata, "reader_agent_metadata")
        if name == slot.agent.name:
            raise InvalidArgumentError("reader_agent_metadata", f"agent {name!r} is this engine's own agent")
        reader = (request.reader_engine_id, request.reader_tp_rank)
        config = self.daemon.config
        limits = ReaderLimits(config.max_readers_per_engine, config.max_readers_per_identity, config.reader_idle_s)
        introduction = slot.holder.introduce(reader, Reader(name, request.reader_tp_size, expected, identity),
                                             reads_here=bool(notifying[request.reader_tp_rank]), limits=limits)
        if introduction.outcome is Introduced.REPLACED:  # not a plain OK: the old agent's notices count no more
            audit.reader_replaced(slot.engine_id, reader, identity, introduction.replaced_agent, name, peer)
        # An identity whose last introduction here was evicted: the metadata it was given must reach nothing.
        if slot.served is not None and any(slot.readers.count(who) == 0 for who, *_ in introduction.evicted):
            slot.served.replace(INTRODUCTION_ENDED)
        self.daemon.writes.forget_targets(slot, introduction.evicted)  # their push connections too
        self.daemon.dataplane.wake()  # to poll fast: its handshake's probe READs our board next

    @rpc
    async def GetIncarnation(self, request, context):
        identity, _ = self._authorize(context)
        slot = self.daemon.registry.slot(request.engine_id, retiring=True)  # (its holds may still be read)
        # A reader's daemon probes every peer_check_s: that keeps its introduction active, and tells it when
        # its place was given to another reader (it then introduces it again before its notices are dropped).
        known = bool(request.reader_engine_id) and slot.readers.refresh(
            (request.reader_engine_id, request.reader_tp_rank), identity)
        return pb.IncarnationReply(incarnation=slot.peer_incarnation(), reader_known=known)

    @rpc
    async def RenewLeases(self, request, context):
        self._authorize(context)
        return pb.RenewLeaseReply(unknown_request_ids=renew_holds(self.daemon,
                                                                  self.daemon.registry.slot(request.engine_id,
                                                                                            retiring=True), request))
