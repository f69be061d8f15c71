"""Handshakes with remote engines and keeping them current.

A link is one (local engine, remote engine) pair: the remote daemons'
addresses (one per remote TP rank), their incarnations and the connected
plan. Handshakes are idempotent and shared: concurrent callers for the same
remote await one attempt; other remotes are never blocked by it (the slow
part, fetching engine info, is async; only the final connect runs on the
data-plane thread, for milliseconds).

A link turns stale when a read to it fails or a probe sees a new
incarnation (the remote restarted); the next handshake replaces the plan
and the NIXL agents, and reads still in flight to the old incarnation fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
import ipaddress
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvxferd.errors import (InvalidArgumentError, KvxferError, LayoutMismatchError, NotFoundError, PermissionDeniedError,
                            ResourceExhaustedError, TransferError)
from kvxferd.plan.groups import VmmShare
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.service.dataplane.thread import DataPlane
from kvxferd.service.base.metrics import Metrics
from kvxferd.service.base.transports import TransportPaths
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.service.peers.proof import check_signed_proof
from kvxferd.service.peers.tls import TlsFiles
from kvxferd.wire.challenge import CHALLENGE_KEY, NONCE_BYTES, Nonces, new_nonce, proof_matches
from kvxferd.wire.peerauth import refuse_listener, secret_call_metadata
from kvxferd.wire.samehost import same_host_token, shares_from
from kvxferd.wire.peerinfo import PROTOCOL_VERSION, decode_info, encode_info
from kvxferd.xfer.records import RemoteEngine
from kvxferd.xfer.samehost.opened import OpenedObjects
from kvxferd.xfer.samehost.vmmshare import fetch_shares

log = logging.getLogger("kvxferd.peers")


@dataclass(eq=False)
class RemoteLink:
    remote_engine_id: str
    addresses: tuple[str, ...]
    incarnations: tuple[str, ...] = ()
    remote: RemoteEngine | None = None
    stale: bool = True
    pending: asyncio.Future | None = field(default=None, repr=False)
    pending_addresses: tuple[str, ...] = ()
    checked_s: float = 0.0  # monotonic: the last probe a read's capability asked for (at most one a second)
    writer_agents: tuple[str, ...] = ()  # per remote rank: whose notices end its pushes ("": it does not push)
    failed_rehandshakes: int = 0  # in a row, by the probes (the first is a warning, the rest debug lines)
    retry_s: float = 0.0  # monotonic: the probes' next re-handshake of this stale link (backing off)
    # Told whenever ``ready`` turns (engine id, ready): the reader worker serving the engine's session posts on
    # a ready link only (service/net/sessions.py).
    on_ready: Callable[[str, bool], None] | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.remote is not None and not self.stale and self.pending is None

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in _READINESS and (on_ready := self.__dict__.get("on_ready")) is not None:
            ready = self.ready
            if ready != self.__dict__.get("_told_ready", False):
                object.__setattr__(self, "_told_ready", ready)
                on_ready(self.remote_engine_id, ready)


_READINESS = frozenset({"remote", "stale", "pending"})  # what RemoteLink.ready is made of


@dataclass(eq=False)
class _PeerChannel:
    """A channel to one peer address and the calls using it now (event-loop side)."""

    channel: grpc.aio.Channel
    tls_generation: int = -1  # which TLS files it was made with (-1: no TLS)
    num_calls: int = 0
    retired: bool = False  # replaced after a failure or a certificate rotation: close once the last call ends


PROBE_POLL_MIN_S, PROBE_POLL_MAX_S = 50e-6, 1e-3  # how the handshake's probe is polled (growing sleeps)
PEER_RETRY_S = 2.0  # how long the one retry's challenge waits for the peer to accept (it carries nothing secret)


class Peers:
    """Outgoing peer calls of one daemon."""

    def __init__(self, dataplane: DataPlane, metrics: Metrics, *, timeout_s: float, max_message_bytes: int,
                 tls: TlsFiles | None = None, server_name: str = "kvxferd-peer", insecure: bool = False) -> None:
        self.dataplane = dataplane
        self.tls = tls
        self.insecure = insecure  # without TLS, dial peers beyond loopback too (--insecure, development only)
        self.metrics = metrics
        self.transports = TransportPaths()  # the daemon's own, once it reads UCX's reports (base/transports.py)
        self.timeout_s = timeout_s
        # Own subchannels per channel: gRPC otherwise shares one per address
        # process-wide, so a "fresh" channel would inherit a dead peer's backoff.
        self._options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.use_local_subchannel_pool", 1),
                         ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls is not None:  # every peer's certificate must name server_name (we dial addresses, not names)
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._channels: dict[str, _PeerChannel] = {}
        # Without TLS: this host's peer secret (set at start; kvxferd.wire.peerauth). Calls carry its token, and
        # the peer servicer checks tokens with it.
        self.secret: bytes | None = None
        # Same-host reads (set at start: config.same_host_reads): the secret that proves this host (without TLS
        # the peer secret; with TLS the same file, for this alone). Every holder is asked to name its memory,
        # proving this host; a holder that does is read by copying (kvxferd.xfer.samehost.hostmaps, devicemaps).
        self.same_host_secret: bytes | None = None
        # Push (issue #57, config.push_targets): this daemon's ranks name themselves as write targets at their
        # handshakes (their data agent's metadata goes to the holder); off: no holder learns it, none pushes here.
        self.push_targets = True
        # config.same_host_writes: a rank named as a push target names its engine's shared memory too (the
        # writer maps it only once this daemon's same-host token proved the host: needs same_host_secret).
        self.same_host_writes = True

    def _channel(self, address: str) -> "_PeerChannel":
        """The channel to ``address``; a new one after the TLS files changed (new connections, new certificate)."""
        entry = self._channels.get(address)
        if entry is not None and self.tls is not None and self.tls.current().generation != entry.tls_generation:
            self._retire(address, entry)
            entry = None
        if entry is None:
            if self.tls is None:
                entry = _PeerChannel(grpc.aio.insecure_channel(address, options=self._options))
            else:
                generation, credentials = self.tls.channel_credentials()
                entry = _PeerChannel(grpc.aio.secure_channel(address, credentials, options=self._options), generation)
            self._channels[address] = entry
        return entry

    def _retire(self, address: str, entry: "_PeerChannel") -> None:
        """Stop handing out ``entry``; it is closed once no call uses it."""
        if self._channels.get(address) is entry:
            del self._channels[address]
        entry.retired = True
        if not entry.num_calls:
            asyncio.ensure_future(entry.channel.close())

    async def _unary(self, address: str, entry: "_PeerChannel", method: str, request, bind, timeout_s: float,
                     wait_for_ready: bool):
        entry.num_calls += 1  # first: the channel is not closed under this call while it waits below
        try:
            deadline_s = time.monotonic() + timeout_s
            stub = peer_grpc.PeerServiceStub(entry.channel)
            # Only the challenge may wait for a server to appear: it carries nothing secret. What follows goes
            # to whoever passed it (kvxferd.wire.challenge).
            nonces = await self._challenge(stub, address, timeout_s, wait_for_ready)
            metadata = (secret_call_metadata(self.secret, address, nonces) if self.secret is not None
                        else ((CHALLENGE_KEY, nonces.text()),))
            request = bind(request, nonces) if bind is not None else request
            return await getattr(stub, method)(request, metadata=metadata,
                                               timeout=max(deadline_s - time.monotonic(), 1e-3))
        finally:
            entry.num_calls -= 1
            if entry.retired and not entry.num_calls:
                await entry.channel.close()

    async def _challenge(self, stub, address: str, timeout_s: float, wait_for_ready: bool) -> Nonces:
        """The nonces of a challenge the server at ``address`` passed; raises :class:`PermissionDeniedError`
        when it did not prove itself (no TLS: the host secret over this address; TLS: a signature by a
        certificate of tls_ca on peer_allowed_ids)."""
        client = new_nonce()
        reply = await stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=client),
                                     timeout=timeout_s, wait_for_ready=wait_for_ready)
        nonces = Nonces(client, bytes(reply.server_nonce))
        if len(nonces.server) != NONCE_BYTES:
            raise PermissionDeniedError("peer_addresses", f"{address}: its challenge answer has no server nonce; "
                                                          "nothing secret was sent to it")
        if self.tls is not None:
            check_signed_proof(self.tls, address, nonces, reply.proof, reply.certificate)
        elif self.secret is None or not proof_matches(self.secret, address, nonces, reply.proof):
            # Who listens there, for the message: asking the kernel takes 0.2-2 ms, off the event loop.
            raise await asyncio.to_thread(refuse_listener, address, "its challenge proof is not this host's "
                                                                    "peer secret")
        return nonces

    async def call(self, address: str, method: str, request, *, timeout_s: float | None = None, bind=None):
        """One peer call after a challenge the peer passed (``bind(request, nonces)`` may complete the request
        with what depends on it); on UNAVAILABLE, once more on a fresh channel.

        A channel whose peer died sits in reconnect backoff (seconds, growing)
        and fails calls fast even after the peer came back on the same
        address; a new channel connects at once. The failed channel is
        retired, and closed only once no call uses it: grpc.aio's close
        cancels every task it finds holding a call on the channel, which
        would cancel a concurrent caller's whole RPC handler.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        entry = self._channel(address)
        try:
            return await self._unary(address, entry, method, request, bind, timeout_s, False)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        if self._channels.get(address) is entry:  # not replaced by a concurrent caller yet
            self._retire(address, entry)
        # The retry's challenge waits for the peer to accept (wait_for_ready) instead of failing on a cached
        # transient failure; bounded, so a dead peer still fails quickly.
        return await self._unary(address, self._channel(address), method, request, bind,
                                 min(timeout_s, PEER_RETRY_S), True)

    def check_dialable(self, addresses: tuple[str, ...]) -> None:
        """Without TLS only loopback IP addresses are dialled, unless the operator said ``insecure``: elsewhere
        the host secret would prove a host nobody chose, over a network in the clear. No names (localhost):
        the challenge's proof covers the address as written, and a name may reach ::1 where the daemon
        listens on 127.0.0.1 only, and another local user on ::1."""
        if self.tls is not None or self.insecure:
            return
        for q, address in enumerate(addresses):
            host = address.rpartition(":")[0].strip("[]")
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise PermissionDeniedError(f"peer_addresses[{q}]", f"{address} is not a loopback IP address: "
                                                                    "without TLS this daemon dials only peers on "
                                                                    "this host, by IP address "
                                                                    "(turn on mutual TLS, or --insecure for "
                                                                    "development)")

    async def close(self) -> None:
        for entry in self._channels.values():
            await entry.channel.close()
        self._channels.clear()

    async def handshake(self, slot: EngineSlot, remote_engine_id: str, addresses: tuple[str, ...] | None = None) -> RemoteLink:
        """Connect ``slot`` to a remote engine (or confirm the connection); shared by concurrent callers.

        New addresses are adopted only once a handshake with them succeeded:
        a bad request never breaks a working link.
        """
        if addresses:
            self.check_dialable(tuple(addresses))
        link = slot.links.get(remote_engine_id)
        if link is None:
            if not addresses:
                raise NotFoundError("remote_engine_id", f"no handshake with {remote_engine_id!r} yet (call Handshake first)")
            reader = slot.reader_worker
            link = slot.links[remote_engine_id] = RemoteLink(remote_engine_id, tuple(addresses),
                                                             on_ready=reader.link_ready if reader is not None else None)
        target = tuple(addresses) if addresses else link.addresses
        # Join only an attempt for the same addresses; wait out attempts for
        # others (however many start meanwhile), then start ours.
        while (pending := link.pending) is not None and not pending.done() and link.pending_addresses != target:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        if link.pending is None or link.pending.done():
            attempt = asyncio.ensure_future(self._handshake(slot, link, target))
            link.pending, link.pending_addresses = attempt, target
            attempt.add_done_callback(lambda f, link=link: link.pending is f and setattr(link, "pending", None))
        await asyncio.shield(link.pending)
        return link

    async def _handshake(self, slot: EngineSlot, link: RemoteLink, addresses: tuple[str, ...]) -> None:
        start = time.perf_counter()
        introduced = slot.notices_metadata  # a data-plane worker's new generation replaces it meanwhile: stale
        try:
            infos = await asyncio.gather(*(self._engine_info(slot, link, q, a, len(addresses))
                                           for q, a in enumerate(addresses)))
            incarnations = tuple(info.incarnation for info in infos)
            if link.remote is not None and not link.stale and incarnations == link.incarnations \
                    and addresses == link.addresses and slot.executor.is_current(link.remote):
                return  # idempotent: nothing changed
            caches, metadata = [i.cache for i in infos], [i.agent_metadata for i in infos]
            boards = [i.board for i in infos]
            # Only holders that named their shared memory and proved this host (_engine_info) are mapped.
            same_host = any(r.share for c in caches for regions in c.memory for r in regions)

            # GPU VMM memory of a same-host holder: its fds fetched here, off the data-plane thread, where a
            # holder that does not answer costs this handshake its budget and no other engine anything.
            opened = None
            if same_host and slot.cache.mem_type == "VRAM" and any(isinstance(r.share, VmmShare) for c in caches
                                                                   for regions in c.memory for r in regions):
                opened = OpenedObjects(partial=True, vmm_fds=await asyncio.to_thread(fetch_shares, caches))

            def connect() -> RemoteEngine:
                with slot.executor.lock:  # no read posted on the loop between failing the old ones and the swap
                    self.dataplane.fail_reads(slot, "the remote engine was re-handshaked (restarted or "
                                                    "unreachable)", link.remote_engine_id, drain=True)
                    return slot.executor.connect(caches, metadata, boards, same_host=same_host, opened=opened)

            try:
                link.remote = await asyncio.wrap_future(self.dataplane.call(connect))
            finally:
                if opened is not None:
                    opened.close()  # (what connect mapped holds its own handles)
            link.addresses = addresses  # the remote connected to: a failed probe leaves the link stale
            probe_s = await self._probe(slot, link.remote, addresses)
            # The probe was the link's first READ: UCX has chosen (and reported) its path by now.
            self.transports.refresh(f"handshake of {slot.engine_id} with {link.remote_engine_id}")
            link.writer_agents = tuple(info.writer_agent_name for info in infos)
            link.incarnations, link.stale = incarnations, slot.notices_metadata is not introduced
            link.failed_rehandshakes, link.retry_s = 0, 0.0
            self.metrics.handshake_duration.labels("ok").observe(time.perf_counter() - start)
            log.info("handshake done", extra={"engine_id": slot.engine_id, "remote_engine_id": link.remote_engine_id,
                                              "remote_tp": len(infos), "duration_s": round(time.perf_counter() - start, 4),
                                              "probe_s": round(probe_s, 4),
                                              "read_paths": "same-host copy" if len(link.remote.host_ranks) == len(infos)
                                              else self.transports.describe(slot.agent.name),
                                              "same_host_ranks": sorted(link.remote.host_ranks),
                                              "same_host_errors": {str(q): e for q, e in link.remote.host_errors.items()
                                                                   if same_host},
                                              "board_errors": {str(q): e for q, e in link.remote.board_errors.items()}})
        except BaseException:
            self.metrics.handshake_duration.labels("failed").observe(time.perf_counter() - start)
            if addresses == link.addresses:
                link.stale = True
            raise

    async def _probe(self, slot: EngineSlot, remote: RemoteEngine, addresses: tuple[str, ...]) -> float:
        """Read every remote rank's hold board once (``BoardProbe``) before the link is ready; its seconds.

        UCX sets a connection up on its first transfer (10-35 ms here, longer
        with the holder busy): paid here, not by the first request. A holder
        whose memory does not answer fails the handshake, naming its address.
        """
        start = time.perf_counter()
        deadline_s, sleep_s = start + self.timeout_s, PROBE_POLL_MIN_S
        probe = slot.executor.start_probe(remote)
        self.dataplane.notices_sent()  # its HELLOs
        try:
            while (errors := slot.executor.poll_probe(remote)) is None:
                if time.perf_counter() >= deadline_s:
                    errors = dict.fromkeys([*probe.waiting, *probe.running], f"no answer in {self.timeout_s:g} s")
                    break
                await asyncio.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, PROBE_POLL_MAX_S)
        finally:
            slot.executor.abort_probe(remote, "the handshake ended")
        if errors:
            q = min(errors)
            raise TransferError(f"peer_addresses[{q}]", f"{addresses[q]}: the data plane did not answer: reading the "
                                                        f"holder's board over NIXL failed: {errors[q]}")
        return time.perf_counter() - start

    async def _engine_info(self, slot: EngineSlot, link: RemoteLink, q: int, address: str, tp_size: int):
        field = f"peer_addresses[{q}]"
        request = pb.EngineInfoRequest(engine_id=link.remote_engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=q,
                                       reader_engine_id=slot.engine_id, reader_tp_rank=slot.cache.tp_rank,
                                       reader_tp_size=slot.cache.tp_size,
                                       reader_agent_metadata=slot.notices_metadata)
        secret = self.same_host_secret
        if slot.served is None and self.push_targets:  # push (issue #57): this rank as a write target, connected
            # by the holder now
            # Its shared memory's names too where a writer may copy into it (host memory only: no GPU share,
            # whose IPC handles and VMM tokens are keys, ever goes to a holder not yet proved).
            names = self.same_host_writes and secret is not None and slot.cache.mem_type == "DRAM"
            request.reader_target.CopyFrom(encode_info(*slot.peer_view(), with_shares=names))

        def bind(request: pb.EngineInfoRequest, nonces: Nonces) -> pb.EngineInfoRequest:
            if secret is not None:  # bound to this call's challenge: good for this call only
                request.same_host_token = same_host_token(secret, address, nonces)
            return request

        try:
            reply = await self.call(address, "GetEngineInfo", request, bind=bind)
        except grpc.aio.AioRpcError as err:
            raise _peer_error(field, address, err) from None
        except KvxferError as err:  # the peer did not pass its challenge
            raise type(err)(field, err.message) from None
        try:
            info = decode_info(reply, slot.cache)
        except KvxferError as err:
            raise type(err)(f"{field}.{err.field}", err.message) from None
        if (info.cache.tp_rank, info.cache.tp_size) != (q, tp_size):
            raise InvalidArgumentError(field, f"{address} serves rank {info.cache.tp_rank}/{info.cache.tp_size}, "
                                              f"expected {q}/{tp_size}")
        return shares_from(info, secret, address, request.same_host_token)  # (only a holder that proved this host)

    async def probe(self, slot: EngineSlot, link: RemoteLink) -> bool:
        """True when every remote rank still runs the incarnation we planned for and still knows this rank as
        its reader (a reader idle for long may lose its place: the next handshake introduces it again)."""
        request = pb.IncarnationRequest(engine_id=link.remote_engine_id, reader_engine_id=slot.engine_id,
                                        reader_tp_rank=slot.cache.tp_rank)

        async def one(address: str, incarnation: str) -> bool:
            try:
                reply = await self.call(address, "GetIncarnation", request)
            except (grpc.aio.AioRpcError, KvxferError):  # unreachable, or (no TLS) served by another user now
                return False
            return reply.incarnation == incarnation and reply.reader_known
        results = await asyncio.gather(*(one(a, i) for a, i in zip(link.addresses, link.incarnations)))
        return all(results)

    async def renew(self, link: RemoteLink, request_ids: list[str], lease_s: float) -> None:
        """Extend the holder's leases on every remote rank holding these requests."""
        if link.remote is None:
            return
        message = pb.RenewLeaseRequest(engine_id=link.remote_engine_id, request_ids=request_ids, lease_s=lease_s)
        calls = [self.call(link.addresses[q], "RenewLeases", message) for q in link.remote.plan.notify_ranks]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.warning("lease renewal failed", extra={"remote_engine_id": link.remote_engine_id, "error": str(outcome)})


# A remote daemon's answer, as the engine that asked for the handshake gets it (docs/protocol.md,
# "Status codes"): permanent refusals keep their code, so an engine that retries on UNAVAILABLE does
# not retry them forever. The remote's UNAUTHENTICATED is about this daemon's credentials (its
# certificate or the host's peer secret), never the engine's session: the engine gets PERMISSION_DENIED.
_PEER_CODES: dict[grpc.StatusCode, type[KvxferError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatchError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNIMPLEMENTED: LayoutMismatchError,  # a daemon of protocol 6 or older has no Challenge
}


def _peer_error(field: str, address: str, err: grpc.aio.AioRpcError) -> KvxferError:
    """A peer's gRPC failure as our typed error, keeping its status meaning (anything else: UNAVAILABLE)."""
    detail = f"{address}: {err.code().name}: {err.details()}"
    return _PEER_CODES.get(err.code(), TransferError)(field, detail)
