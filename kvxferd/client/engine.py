"""A synchronous client of the engine service, for engines, tests and the demo.

Errors come back as :class:`grpc.RpcError` with the daemon's status code and
a message naming the bad field. Completions arrive on a background stream
and wait in its session (:meth:`ReadSession.wait_completion_timed`); heartbeats keep the
registration alive while the client lives.

Reads and their completions go through the registration's session
(:attr:`EngineClient.reads`, :mod:`kvxferd.client.session`: the reads socket
or the gRPC ``Reads`` stream, in batches, numbered and acked; a refused read
comes back as a completion with ``refused_code``). This module is the control
side: registration, heartbeats, handshakes, holds, and the unary calls.

``Register`` returns a session; the client sends it with every later call
(metadata ``kvxferd-session``), so no other local process can act as this
engine. Registering again from the same client replaces the registration;
another client gets ALREADY_EXISTS while this one is alive.

Over a ``unix:`` target the client first checks who listens: the socket
file (before every call: gRPC does not show its peer) and the reads
socket's process (``SO_PEERCRED``) must be the daemon's uid, its own
unless ``daemon_uid`` names another. Else the call raises
:class:`~kvxferd.errors.PermissionDeniedError` naming the uid found, and
nothing (no session, no memory handle) was sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import grpc

from kvxferd.client.control import ControlSession
from kvxferd.client.session import Held, LostRead, ReadSession
from kvxferd.errors import PermissionDeniedError
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.owner import check_daemon_socket, daemon_uid_or_own
from kvxferd.wire.frames import reads_socket_path
from kvxferd.wire.messages import ids_to_pb, read_spec_to_pb
from kvxferd.wire.names import SESSION_KEY

log = logging.getLogger("kvxferd.client")

__all__ = ["EngineClient", "Held", "LostRead"]


class _CallMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamStreamClientInterceptor):
    """Adds the engine's session (and the engine_tcp bearer token) to every call."""

    def __init__(self, client: "EngineClient") -> None:
        self.client = client

    def _details(self, details):
        if self.client.socket_path is not None:  # before anything is sent: who listens there
            check_daemon_socket(self.client.socket_path, self.client.daemon_uid)
        extra = [(SESSION_KEY, self.client.session)] if self.client.session else []
        if self.client.token:
            extra.append(("authorization", f"Bearer {self.client.token}"))
        if not extra:
            return details
        return details._replace(metadata=[*(details.metadata or ()), *extra])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class EngineClient:
    """One engine rank's connection to its local daemon."""

    def __init__(self, target: str, *, timeout_s: float = 30.0, max_message_bytes: int = 16 << 20,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 channel_options: Sequence[tuple[str, object]] = (), reads_socket: bool = True,
                 daemon_uid: int | None = None, register_timeout_s: float | None = None) -> None:
        """``target``: ``unix:PATH`` (the default daemon socket) or, with ``credentials`` (TLS) and
        ``token``, the daemon's ``engine_tcp`` address (``channel_options`` e.g. a TLS target name override).
        ``reads_socket``: a ``unix:`` target's reads go over the daemon's reads socket (the same
        batches without gRPC) when it offers one, else over the gRPC ``Reads`` stream.
        ``daemon_uid``: the uid the daemon of a ``unix:`` target runs as (default: this process's); a
        socket of anyone else is refused before anything is sent (:class:`PermissionDeniedError`).
        ``register_timeout_s`` (default ``timeout_s``): Register maps and registers the cache (and with
        data-plane workers starts one), so it may take longer than other calls. A caller that gives up
        mid-way leaves a registration whose session it never learnt: the daemon finishes it and a retry
        is refused ALREADY_EXISTS until its lease runs out."""
        self.target = target
        self.daemon_uid = daemon_uid_or_own(daemon_uid)
        self.socket_path = target.removeprefix("unix:") if target.startswith("unix:") else None
        self.max_message_bytes = max_message_bytes
        self.reads_socket_path = (reads_socket_path(self.socket_path)
                                  if reads_socket and self.socket_path is not None else None)
        self.timeout_s = timeout_s
        self.register_timeout_s = register_timeout_s if register_timeout_s is not None else timeout_s
        self.session, self.token = "", token
        options = [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes),
                   *channel_options]
        channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
                   else grpc.insecure_channel(target, options=options))
        self._channel = grpc.intercept_channel(channel, _CallMetadata(self))
        self._raw_channel = channel
        self.stub = engine_grpc.EngineServiceStub(self._channel)
        self.engine_id: str | None = None
        self.incarnation = self.notify_address = self.notify_curve_server_key = ""
        self.notify_last_seq = 0
        self.incarnations: list[str] = []  # of every registration this client made, the current one last
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reads = ReadSession(self)  # reads, completions and socket holds of the current registration
        self._control: ControlSession | None = None  # holds of a registration another process made
        self._control_lock = threading.Lock()
        self._register_request: pb.RegisterRequest | None = None  # what re-registering sends again
        self._fd_source: Callable[[], str] | None = None  # passes the fds again; returns their token
        self._register_lock = threading.Lock()
        self.num_reregistrations = 0  # times a heartbeat found the registration gone and registered again

    # ---- registration -------------------------------------------------------------
    def register(self, engine: pb.EngineRank, *, lease_s: float = 0.0, heartbeat_s: float | None = None,
                 fd_token: str = "", allowed_reader_engine_ids: Sequence[str] = (),
                 fd_source: Callable[[], str] | None = None,
                 process_fd_index: int | None = None) -> pb.RegisterReply:
        """Register this rank, then heartbeat every ``heartbeat_s`` (lease / 3) and watch completions.

        Call it again to re-register: the completion stream is opened anew
        and a :class:`NotifySubscriber` of this client follows the new
        registration's event sequence. The heartbeat does that by itself when
        the daemon answers NOT_FOUND (it restarted, or its lease ran out while
        it could not hear this client). Memory passed as fds (``fd_token``) must
        be passed again first: give ``fd_source``, which passes them and returns
        the new token; without it such a registration is not renewed.
        ``process_fd_index``: which of those fds is this process's pidfd
        (:func:`kvxferd.client.fdsend.own_process_fd`): the daemon lets go of
        the registration the moment this process exits.
        """
        request = pb.RegisterRequest(engine=engine, lease_s=lease_s, fd_token=fd_token,
                                     allowed_reader_engine_ids=list(allowed_reader_engine_ids),
                                     process_fd_index=process_fd_index)
        first = self.engine_id is None
        reply = self._send_register(request)
        self._register_request = None if fd_token and fd_source is None else request
        self._fd_source = fd_source
        interval_s = heartbeat_s if heartbeat_s is not None else (lease_s or 30.0) / 3
        if first and interval_s > 0:
            self.start_thread(lambda: self._heartbeat(interval_s))
        return reply

    def _send_register(self, request: pb.RegisterRequest, again: bool = False,
                       num_registrations: int | None = None) -> pb.RegisterReply | None:
        """Register; with ``num_registrations``, only if this client made no registration since it had
        that many (else None: the newer registration stands)."""
        with self._register_lock:
            if num_registrations is not None and len(self.incarnations) != num_registrations:
                return None
            reply = self.stub.Register(request, timeout=self.register_timeout_s)
            self._registered(request.engine, reply, again)
        return reply

    def _registered(self, engine: pb.EngineRank, reply: pb.RegisterReply, again: bool) -> None:
        if again:  # counted before the new incarnation shows: whoever sees it sees the count too
            self.num_reregistrations += 1
        self.session, self.notify_curve_server_key = reply.session, reply.notify_curve_server_key
        self.engine_id, self.notify_address = engine.engine_id, reply.notify_address
        self.notify_last_seq, self.incarnation = reply.notify_last_seq, reply.incarnation
        self.incarnations.append(reply.incarnation)
        self.reads.restart()  # a new registration numbers from 1; reads of the old one failed with it

    def start_thread(self, target) -> None:
        """A daemon thread of this client (heartbeats, the session's receiver), stopped by :meth:`close`."""
        thread = threading.Thread(target=target, daemon=True, name="kvxferd-client")
        thread.start()
        self._threads.append(thread)

    def _heartbeat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            num_registrations = len(self.incarnations)
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(engine_id=self.engine_id), timeout=self.timeout_s)
            except grpc.RpcError as err:
                # NOT_FOUND: this daemon does not know the registration (a restart, or a lease that ran
                # out while it could not hear us): register the same cache again. Anything else (the
                # daemon is down, draining, or another client took the engine id) is left alone.
                if err.code() == grpc.StatusCode.NOT_FOUND and self._register_request is not None:
                    self._register_again(num_registrations)
            except PermissionDeniedError:
                pass  # someone else's socket is in the daemon's place: nothing was sent; try again later

    def _register_again(self, num_registrations: int) -> None:
        """Register the same cache again, unless someone registered it since the heartbeat went out:
        replacing that fresh registration would end its stream and lose the reads sent on it."""
        if self._stop.is_set() or len(self.incarnations) != num_registrations:
            return
        try:
            if self._fd_source is not None:
                self._register_request.fd_token = self._fd_source()
            self._send_register(self._register_request, again=True, num_registrations=num_registrations)
        except (grpc.RpcError, OSError, PermissionDeniedError):
            pass  # the next heartbeat tries again (OSError: the fds could not be passed; a foreign socket)

    def reconnect_reads(self) -> None:
        """Open a new session transport (after a broken one); unacked completions come again, deduplicated."""
        self.reads.open()

    def deregister(self) -> None:
        self._stop.set()
        self.stub.Deregister(pb.DeregisterRequest(engine_id=self.engine_id), timeout=self.timeout_s)

    def close(self) -> None:
        """Stop heartbeats and the stream, close the channel (does not deregister)."""
        self._stop.set()
        self.reads.close()
        with self._control_lock:
            if self._control is not None:
                self._control.close()
        self._raw_channel.close()

    # ---- reads ----------------------------------------------------------------------
    def handshake(self, remote_engine_id: str, peer_addresses: Sequence[str]) -> pb.HandshakeReply:
        return self.stub.Handshake(pb.HandshakeRequest(engine_id=self.engine_id, remote_engine_id=remote_engine_id,
                                                       peer_addresses=list(peer_addresses)), timeout=self.timeout_s)

    def submit_read(self, request_id: str, remote_engine_id: str, remote_request_id: str, local_block_ids,
                    remote_block_ids, *, num_tokens: int = 0, deadline_s: float = 0.0,
                    remote_capabilities: Sequence[bytes] = (), remote_digests: Sequence[bytes] = (),
                    traceparent: str = "") -> None:
        """One read as a batch of one on the session (:meth:`ReadSession.submit_reads`); its completion, or its
        refusal (``refused_code``), comes back like any other. ``remote_capabilities``: each remote rank's
        :attr:`Held.capability` of the hold, in rank order; ``remote_digests`` likewise their
        :attr:`Held.digests` (all or none), to have the blocks checked before the read completes."""
        self.reads.submit_reads([self.read_spec(request_id, remote_engine_id, remote_request_id, local_block_ids,
                                                remote_block_ids, num_tokens=num_tokens, deadline_s=deadline_s,
                                                remote_capabilities=remote_capabilities,
                                                remote_digests=remote_digests, traceparent=traceparent)])

    def submit_push(self, request_id: str, remote_engine_id: str, transfer_id: str, push_key: bytes,
                    local_block_ids, *, num_tokens: int = 0, deadline_s: float = 0.0) -> None:
        """Expect a push (issue #57): the prefill ranks of ``remote_engine_id`` WRITE into ``local_block_ids`` (per
        cache group: only the blocks this engine does not hold already) once their engine holds
        ``transfer_id`` with the digest of ``push_key``; the completion comes as a read's, when every prefill
        rank wrote or the push failed (every block invalid). Needs a handshake with the prefill engine first,
        as a read does."""
        self.reads.submit_reads([self.push_spec(request_id, remote_engine_id, transfer_id, push_key, local_block_ids,
                                                num_tokens=num_tokens, deadline_s=deadline_s)])

    @classmethod
    def push_spec(cls, request_id: str, remote_engine_id: str, transfer_id: str, push_key: bytes, local_block_ids,
                  *, num_tokens: int = 0, deadline_s: float = 0.0) -> pb.ReadSpec:
        """One push expectation for :meth:`ReadSession.submit_reads` (see :meth:`submit_push`)."""
        spec = cls.read_spec(request_id, remote_engine_id, transfer_id, local_block_ids,
                             tuple(() for _ in local_block_ids), num_tokens=num_tokens, deadline_s=deadline_s)
        spec.push, spec.push_key = True, push_key
        return spec

    @staticmethod
    def read_spec(request_id: str, remote_engine_id: str, remote_request_id: str, local_block_ids, remote_block_ids,
                  *, num_tokens: int = 0, deadline_s: float = 0.0, remote_capabilities: Sequence[bytes] = (),
                  remote_digests: Sequence[bytes] = (), traceparent: str = "") -> pb.ReadSpec:
        """One read for :meth:`submit_reads` (block ids per cache group; capabilities and digests per remote
        rank; ``traceparent``: the request's W3C trace context, for the daemon's OpenTelemetry span)."""
        return read_spec_to_pb(request_id, remote_engine_id, remote_request_id, local_block_ids, remote_block_ids,
                               num_tokens, deadline_s, remote_capabilities, remote_digests, traceparent)

    # ---- holds ------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids, *, lease_s: float = 0.0, push_key_digest: bytes = b"",
             layers_final: Sequence[int] = (), want_digests: bool = False, traceparent: str = "") -> Held:
        """Hold blocks for readers: the incarnation of the registration that holds them and the hold's
        capability (readers present it). On the reads socket when this client has a session there (no
        gRPC call), else the ``Hold`` call; either way a refusal raises :class:`grpc.RpcError` with the
        daemon's status code. ``push_key_digest`` (a push's prefill leg, issue #57): the hold's blocks are
        written to the decode rank whose expectation presents the key
        (:func:`kvxferd.plan.capability.push_key_digest`). ``layers_final`` (a push written layer by layer): per
        cache group, how many of its layers hold final KV already; :meth:`final_layers` says when more do.
        ``want_digests`` (issue #59): the daemon digests the held blocks too (:attr:`Held.digests`; readers
        pass every rank's as ``remote_digests`` to have what they read checked). ``traceparent``: the request's
        W3C trace context (issue #60), the parent of the daemon's span of the hold."""
        return self.hold_started(request_id, block_ids, lease_s=lease_s, push_key_digest=push_key_digest,
                                 layers_final=layers_final, want_digests=want_digests, traceparent=traceparent)()

    def hold_started(self, request_id: str, block_ids, *, lease_s: float = 0.0, push_key_digest: bytes = b"",
                     layers_final: Sequence[int] = (), want_digests: bool = False,
                     traceparent: str = "") -> Callable[[], Held]:
        """:meth:`hold`, sent without waiting for its answer: a function that waits for it (and raises as
        :meth:`hold` does). Several daemons' holds are then in flight at once (a TP engine's ranks)."""
        request = pb.HoldRequest(engine_id=self.engine_id, request_id=request_id, block_ids=ids_to_pb(block_ids),
                                 lease_s=lease_s, push_key_digest=push_key_digest, layers_final=list(layers_final),
                                 want_digests=want_digests, traceparent=traceparent)
        control = self.control_session()
        if control is not None:
            return control.hold_started(request)
        held = self.reads.hold(request)
        if held is not None:
            return lambda: held
        call = self.stub.Hold.future(request, timeout=self.timeout_s)

        def answer() -> Held:
            reply = call.result()
            return Held(reply.incarnation, reply.capability, reply.digests)
        return answer

    def final_layers(self, request_id: str, layers_final: Sequence[int]) -> None:
        """More layers of a hold placed with ``layers_final`` hold final KV (per group, never fewer than said
        before; every group's full count: all of them): the push writes them. Returns once sent, without an
        answer, on the reads socket when there is a session there; else the ``FinalLayers`` call, also not
        waited for (a refusal is logged: the push then fails by its deadline)."""
        request = pb.FinalLayersRequest(engine_id=self.engine_id, request_id=request_id,
                                        layers_final=list(layers_final))
        control = self.control_session()
        if control is not None:
            control.final_layers(request)
            return
        if self.reads.final_layers(request):
            return
        call = self.stub.FinalLayers.future(request, timeout=self.timeout_s)
        call.add_done_callback(lambda done: done.exception() is not None and log.warning(
            "FinalLayers was refused: the push fails by its deadline",
            extra={"request_id": request_id, "error": str(done.exception())}))

    def renew(self, request_ids: Sequence[str], *, lease_s: float = 0.0) -> list[str]:
        """Extend holds; the ids the daemon does not hold (on the control session when there is one)."""
        control = self.control_session()
        if control is not None:
            return control.renew(request_ids, lease_s)
        reply = self.stub.RenewLease(pb.RenewLeaseRequest(engine_id=self.engine_id, request_ids=list(request_ids),
                                                          lease_s=lease_s), timeout=self.timeout_s)
        return list(reply.unknown_request_ids)

    def release(self, request_id: str) -> None:
        """End a hold now. On a control session this returns once it is sent (the daemon takes it before
        anything sent later, a new hold of the same id too); else it waits for the ``Release`` call."""
        control = self.control_session()
        if control is not None:
            control.release(request_id)
            return
        self.stub.Release(pb.ReleaseRequest(engine_id=self.engine_id, request_id=request_id), timeout=self.timeout_s)

    def control_session(self) -> ControlSession | None:
        """The control session of a client that holds for a registration another process made (vLLM's
        scheduler: ``engine_id`` and ``session`` set, never registered here), when the daemon offers a
        reads socket; None otherwise (a registered client holds on its own session)."""
        if self.incarnations or not ControlSession.available(self.reads_socket_path):
            return None
        with self._control_lock:
            if self._control is not None and (self._control.engine_id, self._control.session) != (self.engine_id,
                                                                                                 self.session):
                self._control.close()  # another registration's now (the scheduler learnt a new session)
                self._control = None
            if self._control is None:
                self._control = ControlSession(self.reads_socket_path, self.engine_id, self.session,
                                               timeout_s=self.timeout_s, max_frame_bytes=self.max_message_bytes,
                                               daemon_uid=self.daemon_uid)
                if self._stop.is_set():  # closed meanwhile: nothing is sent on it
                    self._control.close()
            return self._control

    def missed_events(self, after_seq: int) -> pb.MissedEventsReply:
        return self.stub.MissedEvents(pb.MissedEventsRequest(engine_id=self.engine_id, after_seq=after_seq),
                                      timeout=self.timeout_s)
