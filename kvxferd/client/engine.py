"""A synchronous client of the engine service, for engines, tests and the demo.

Errors come back as :class:`grpc.RpcError` with the daemon's status code and
a message naming the bad field. Completions arrive on a background stream
and wait in :meth:`EngineClient.wait_completion`; heartbeats keep the
registration alive while the client lives.

``Register`` returns a session; the client sends it with every later call
(metadata ``kvxferd-session``), so no other local process can act as this
engine. Registering again from the same client replaces the registration;
another client gets ALREADY_EXISTS while this one is alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxferd.service.wire import ids_to_pb


SESSION_KEY = "kvxferd-session"


class _CallMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the engine's session (and the engine_tcp bearer token) to every call."""

    def __init__(self, client: "EngineClient") -> None:
        self.client = client

    def _details(self, details):
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


class EngineClient:
    """One engine rank's connection to its local daemon."""

    def __init__(self, target: str, *, timeout_s: float = 30.0, max_message_bytes: int = 16 << 20,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 channel_options: Sequence[tuple[str, object]] = ()) -> None:
        """``target``: ``unix:PATH`` (the default daemon socket) or, with ``credentials`` (TLS) and
        ``token``, the daemon's ``engine_tcp`` address (``channel_options`` e.g. a TLS target name override)."""
        self.target = target
        self.timeout_s = timeout_s
        self.session, self.token = "", token
        options = [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes),
                   *channel_options]
        channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
                   else grpc.insecure_channel(target, options=options))
        self._channel = grpc.intercept_channel(channel, _CallMetadata(self))
        self._raw_channel = channel
        self.stub = pb_grpc.EngineServiceStub(self._channel)
        self.engine_id: str | None = None
        self.incarnation = self.notify_address = self.notify_curve_server_key = ""
        self.notify_last_seq = 0
        self._completions: dict[str, tuple[pb.Completion, float]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stream = None
        self.stream_error: grpc.RpcError | None = None

    # ---- registration -------------------------------------------------------------
    def register(self, engine: pb.EngineRank, *, lease_s: float = 0.0, heartbeat_s: float | None = None,
                 fd_token: str = "", allowed_reader_engine_ids: Sequence[str] = ()) -> pb.RegisterReply:
        """Register this rank, then heartbeat every ``heartbeat_s`` (lease / 3) and watch completions.

        Call it again to re-register (e.g. after the daemon restarted): the
        completion stream is opened anew and a :class:`NotifySubscriber` of
        this client follows the new registration's event sequence.
        """
        reply = self.stub.Register(pb.RegisterRequest(engine=engine, lease_s=lease_s, fd_token=fd_token,
                                                      allowed_reader_engine_ids=list(allowed_reader_engine_ids)),
                                   timeout=self.timeout_s)
        self.session, self.notify_curve_server_key = reply.session, reply.notify_curve_server_key
        first = self.engine_id is None
        if self._stream is not None:
            self._stream.cancel()
        self.engine_id, self.notify_address = engine.engine_id, reply.notify_address
        self.notify_last_seq, self.incarnation = reply.notify_last_seq, reply.incarnation
        self.stream_error = None
        self._stream = stream = self.stub.WatchCompletions(pb.WatchCompletionsRequest(engine_id=self.engine_id))
        self._start(lambda: self._watch(stream))
        interval_s = heartbeat_s if heartbeat_s is not None else (lease_s or 30.0) / 3
        if first and interval_s > 0:
            self._start(lambda: self._heartbeat(interval_s))
        return reply

    def _start(self, target) -> None:
        thread = threading.Thread(target=target, daemon=True, name="kvxferd-client")
        thread.start()
        self._threads.append(thread)

    def _heartbeat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(engine_id=self.engine_id), timeout=self.timeout_s)
            except grpc.RpcError:
                pass  # the daemon restarted or is draining; register() again

    def _watch(self, stream) -> None:
        try:
            for completion in stream:
                with self._cond:
                    self._completions[completion.request_id] = (completion, time.time())
                    self._cond.notify_all()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED and stream is self._stream:
                self.stream_error = err
        with self._cond:
            self._cond.notify_all()

    def deregister(self) -> None:
        self._stop.set()
        self.stub.Deregister(pb.DeregisterRequest(engine_id=self.engine_id), timeout=self.timeout_s)

    def close(self) -> None:
        """Stop heartbeats and the stream, close the channel (does not deregister)."""
        self._stop.set()
        if self._stream is not None:
            self._stream.cancel()
        self._raw_channel.close()

    # ---- reads ----------------------------------------------------------------------
    def handshake(self, remote_engine_id: str, peer_addresses: Sequence[str]) -> pb.HandshakeReply:
        return self.stub.Handshake(pb.HandshakeRequest(engine_id=self.engine_id, remote_engine_id=remote_engine_id,
                                                       peer_addresses=list(peer_addresses)), timeout=self.timeout_s)

    def _read_message(self, request_id, remote_engine_id, remote_request_id, local_block_ids, remote_block_ids,
                      num_tokens, deadline_s) -> pb.SubmitReadRequest:
        return pb.SubmitReadRequest(
            engine_id=self.engine_id, request_id=request_id, remote_engine_id=remote_engine_id,
            remote_request_id=remote_request_id, local_block_ids=ids_to_pb(local_block_ids),
            remote_block_ids=ids_to_pb(remote_block_ids), num_tokens=num_tokens, deadline_s=deadline_s)

    def submit_read(self, request_id: str, remote_engine_id: str, remote_request_id: str, local_block_ids,
                    remote_block_ids, *, num_tokens: int = 0, deadline_s: float = 0.0) -> None:
        """Submit a read; returns once the daemon accepted it (completion comes later)."""
        self.stub.SubmitRead(self._read_message(request_id, remote_engine_id, remote_request_id, local_block_ids,
                                                remote_block_ids, num_tokens, deadline_s), timeout=self.timeout_s)

    def submit_read_async(self, request_id: str, remote_engine_id: str, remote_request_id: str, local_block_ids,
                          remote_block_ids, *, num_tokens: int = 0, deadline_s: float = 0.0) -> grpc.Future:
        """Submit without waiting; ``.result()`` raises the daemon's error; ``.call_s`` is the RPC time once done."""
        start = time.perf_counter()
        future = self.stub.SubmitRead.future(self._read_message(request_id, remote_engine_id, remote_request_id,
                                                                local_block_ids, remote_block_ids, num_tokens,
                                                                deadline_s), timeout=self.timeout_s)
        future.add_done_callback(lambda f: setattr(f, "call_s", time.perf_counter() - start))
        return future

    def wait_completion(self, request_id: str, timeout_s: float = 30.0) -> pb.Completion:
        """The completion of ``request_id`` (raises ``TimeoutError``)."""
        return self.wait_completion_timed(request_id, timeout_s)[0]

    def wait_completion_timed(self, request_id: str, timeout_s: float = 30.0) -> tuple[pb.Completion, float]:
        """The completion and the wall-clock time it reached this client."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._completions:
                left = deadline - time.monotonic()
                if left <= 0 or self.stream_error is not None:
                    raise TimeoutError(f"no completion for {request_id!r} after {timeout_s:g} s"
                                       + (f" (stream: {self.stream_error.code().name})" if self.stream_error else ""))
                self._cond.wait(left)
            return self._completions.pop(request_id)

    def take_completions(self) -> list[pb.Completion]:
        """Every completion that arrived and was not taken yet (never blocks)."""
        with self._cond:
            taken = [completion for completion, _ in self._completions.values()]
            self._completions.clear()
        return taken

    # ---- holds ------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids, *, lease_s: float = 0.0) -> None:
        self.stub.Hold(pb.HoldRequest(engine_id=self.engine_id, request_id=request_id, block_ids=ids_to_pb(block_ids),
                                      lease_s=lease_s), timeout=self.timeout_s)

    def renew(self, request_ids: Sequence[str], *, lease_s: float = 0.0) -> list[str]:
        reply = self.stub.RenewLease(pb.RenewLeaseRequest(engine_id=self.engine_id, request_ids=list(request_ids),
                                                          lease_s=lease_s), timeout=self.timeout_s)
        return list(reply.unknown_request_ids)

    def release(self, request_id: str) -> None:
        self.stub.Release(pb.ReleaseRequest(engine_id=self.engine_id, request_id=request_id), timeout=self.timeout_s)

    def missed_events(self, after_seq: int) -> pb.MissedEventsReply:
        return self.stub.MissedEvents(pb.MissedEventsRequest(engine_id=self.engine_id, after_seq=after_seq),
                                      timeout=self.timeout_s)
