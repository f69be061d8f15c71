"""The reads socket: an engine's read batches and their completions without gRPC's framework.

The gRPC ``Reads`` stream costs 150-500 µs per message each way on this
machine (``kvxferd bench floors``): most of an engine's per-request
overhead. The same batches over a plain UNIX stream socket next to the
engine socket cost tens of µs (``wire/frames.py`` has the framing)::

    engine                                  daemon (event loop, asyncio protocol)
    connect <engine_socket>.reads ───────►  SO_PEERCRED: an allowed uid, else closed
    ReadBatch{engine_id, session, ...} ──►  the registration's session, else the end frame
    ReadBatch{reads, ack_seq} ───────────►  ReadPath.take_batch (as the gRPC stream)
    ReadBatch{holds} ────────────────────►  place_hold, each (as the Hold call)
                                  ◄───────  CompletionBatch{holds: one answer per hold}, at once
    ReadBatch{renewals, releases} ───────►  RenewLease, Release, each (renewals answered, in order)
                                  ◄───────  CompletionBatch{completions} (the engine's feed; an ok
                                            read's own frame, written by the data-plane thread)
                                  ◄───────  CompletionBatch{end_code, end_message}, then close

A first batch with ``control`` opens a control session (vLLM's scheduler
process, :mod:`kvxferd.client.control`): holds, renewals and releases of the
registration, no reads; it never takes the registration's completions, so
it runs beside the engine's own session, and it follows the registration
by its session (a re-registration that kept the session keeps it going).

One session per connection, the same rules as the gRPC stream: the first
batch must come within ``hello_timeout_s``; a frame over
``max_message_bytes``, a batch that does not parse or breaks a rule ends the
session with a status code and why (the engine reconnects: nothing is
lost, completions not acked come again). A session that stops reading
stops taking completions (its writer's buffer is bounded), and unacked
completions count against ``max_reads_per_engine``. Every frame back goes
through one :class:`FrameWriter`: the loop and the data-plane thread both
write completions (``CompletionFeed.put_direct``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from kvxferd.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.net.framewriter import FrameWriter
from kvxferd.service.net.calls import answer_calls, check_calls
from kvxferd.service.base import audit
from kvxferd.service.base.localsock import credentials_allowed, restrict_socket, socket_umask
from kvxferd.wire.owner import peer_credentials
from kvxferd.service.base.metrics import READS_SOCKET_METHOD
from kvxferd.service.base.status import error_status
from kvxferd.wire.frames import COMPLETIONS_PER_BATCH, FrameReader, encode_frame
from kvxferd.wire.messages import check_id, has_calls

if TYPE_CHECKING:
    from kvxferd.service.net.parts import DaemonParts

log = logging.getLogger("kvxferd.readsock")
METHOD = READS_SOCKET_METHOD  # its label in kvxferd_rpc_errors
WRITE_HIGH_WATER_BYTES = 1 << 20  # a session that does not read stops taking completions beyond this


class ReadSocketServer:
    """The listener; :meth:`start` binds it (mode 0600, 0660 with a group), :meth:`close` ends every session."""

    def __init__(self, daemon: "DaemonParts", path: str, *, allowed_uids: frozenset[int], group: int | None,
                 max_frame_bytes: int, max_sessions: int, hello_timeout_s: float = 2.0) -> None:
        self.daemon, self.path = daemon, path
        self.allowed_uids, self.group = allowed_uids, group
        self.max_frame_bytes, self.max_sessions, self.hello_timeout_s = max_frame_bytes, max_sessions, hello_timeout_s
        self.sessions: set[ReadSession] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        with socket_umask(self.group):  # never world-accessible, not even before the chmod
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: ReadSession(self), self.path)
        restrict_socket(self.path, self.group, self.allowed_uids)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for session in list(self.sessions):
            session.end(grpc.StatusCode.UNAVAILABLE, "engine_id: the daemon is stopping")


class ReadSession(asyncio.Protocol):
    """One engine session on the reads socket (event-loop thread only)."""

    def __init__(self, server: ReadSocketServer) -> None:
        self.server, self.daemon = server, server.daemon
        self.frames = FrameReader(server.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.writer: FrameWriter | None = None  # every frame back; the transport only reads
        self.slot = None
        self.pid = self.uid = -1  # the client's, from SO_PEERCRED
        self.hello_engine_id = ""
        self.control: pb.ReadBatch | None = None  # a control session's first batch (its engine and session)
        self._waited = False  # for a starting reader worker, once (service/net/sessions.py)
        self._waiter: asyncio.Task | None = None
        self.ended = False
        self._sender: asyncio.Task | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    # ---- the connection ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.pid, self.uid, gid = peer_credentials(transport.get_extra_info("socket"))
        if not credentials_allowed(self.uid, gid, self.server.allowed_uids, self.server.group):
            audit.socket_refused("reads", self.uid, self.pid, grpc.StatusCode.PERMISSION_DENIED,
                                 "uid not on allowed_uids (SO_PEERCRED)")
            self.daemon.metrics.rpc_errors.labels(METHOD, grpc.StatusCode.PERMISSION_DENIED.name).inc()
            self.ended = True
            transport.abort()
            return
        self.writer = FrameWriter(asyncio.get_running_loop(), transport.get_extra_info("socket").fileno(),
                                  high_water_bytes=WRITE_HIGH_WATER_BYTES, on_broken=self._broken)
        self.server.sessions.add(self)
        if len(self.server.sessions) > self.server.max_sessions:
            self._end_with(ResourceExhaustedError("reads socket", f"{self.server.max_sessions} sessions are open "
                                                                  "already (max_engines)"))
            return
        self._hello_timer = asyncio.get_running_loop().call_later(
            self.server.hello_timeout_s, lambda: self._end_with(InvalidArgumentError(
                "engine_id", f"no first batch naming the engine within {self.server.hello_timeout_s:g} s")))

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        received_s = time.perf_counter()
        try:
            payloads = self.frames.feed(data)
            for n, payload in enumerate(payloads):
                try:
                    batch = pb.ReadBatch.FromString(payload)
                except DecodeError:
                    raise InvalidArgumentError("frame", "not a ReadBatch") from None
                opening = self.slot is None
                if opening:
                    self._open(batch)
                elif batch.control:
                    raise InvalidArgumentError("control", "only a session's first batch opens a control session")
                # From its first batch with reads on, the session is the engine's reader worker's (an engine
                # that only holds stays here: its holds are this process's anyway).
                if batch.reads and self.control is None and self._to_worker(batch, payloads[n:], opening):
                    return
                if opening and self.control is None:
                    self._sender = self.daemon.spawn(self._send())
                if self.control is None:
                    self.daemon.reads.take_batch(self.slot, batch, received_s)  # the batch's own rules first
                else:
                    self._control_batch(batch)
                if has_calls(batch):
                    check_calls(self.daemon, self.slot, batch, self.writer.writable)
                    for answers in answer_calls(self.daemon, self.slot, batch):
                        self.writer.write(encode_frame(answers))
        except Exception as err:  # ends this session only, with the status an engine would get on gRPC
            self._end_with(err)

    def eof_received(self) -> bool:
        return False  # the engine is done with this session: close it

    def connection_lost(self, exc) -> None:
        self.ended = True
        self.server.sessions.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for task in (self._sender, self._waiter):
            if task is not None:
                task.cancel()
        if self.slot is not None:
            self.slot.completions.detach(self)
        if self.writer is not None:
            self.writer.close()

    def _to_worker(self, batch: pb.ReadBatch, payloads: list[bytes], opening: bool) -> bool:
        """Hand the session, at ``batch`` (``payloads``: it and what came after it), to the engine's reader
        worker: its reads never pass through this process (service/net/sessions.py). A worker that is
        starting (after a death) is waited for, once, the session paused meanwhile (its reads could not
        run here either), up to WAIT_FOR_WORKER_S; True when this process is not to take the batch now."""
        sessions = self.daemon.sessions
        if sessions.hand_over(self, batch, payloads, self.frames.buffered):
            return True
        if self._waited or not sessions.worker_starting(self.slot):
            return False
        self._waited = True
        stash = b"".join(encode_frame(p) for p in payloads) + self.frames.take_buffered()
        if opening:
            self.slot = None  # opened again with the same first batch once the worker is up (or not)
        self.transport.pause_reading()
        self._waiter = self.daemon.spawn(self._after_worker(stash, batch.engine_id or self.slot.engine_id))
        return True

    async def _after_worker(self, stash: bytes, engine_id: str) -> None:
        await self.daemon.sessions.wait_for_worker(engine_id)
        self._waiter = None
        if not self.ended:
            self.transport.resume_reading()
            self.data_received(stash)

    def handed_over(self) -> None:
        """The engine's reader worker has the session now (a copy of its socket): this process lets go of
        its own copy without a word (closing an fd does not shut the connection down)."""
        self.ended = True
        self.server.sessions.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.writer.close()
        self.transport.abort()

    def _broken(self, err: OSError) -> None:
        """A write failed: the engine is gone (the transport sees it too); stop taking completions."""
        if not self.ended:
            self.ended = True
            if self.slot is not None:
                self.slot.completions.poke()
            self.transport.abort()

    # ---- the session ------------------------------------------------------------------
    def _open(self, batch: pb.ReadBatch) -> None:
        """The first batch: the engine and its session (as gRPC's metadata would carry it)."""
        self.hello_engine_id = batch.engine_id[:256]  # for the audit line, should the session be refused
        check_id(batch.engine_id, "engine_id")
        self.slot = self.daemon.registry.session_slot(batch.engine_id, batch.session)
        self._hello_timer.cancel()
        if batch.control:
            self.control = pb.ReadBatch(engine_id=batch.engine_id, session=batch.session)

    def _control_batch(self, batch: pb.ReadBatch) -> None:
        """A control session's batch: no reads, no acks; its registration as it is now (replaced by one
        with the same session, it goes on; gone, or another session's, the session ends)."""
        if batch.reads or batch.ack_seq:
            raise InvalidArgumentError("reads", "a control session carries holds, renewals and releases only")
        self.slot = self.daemon.registry.session_slot(self.control.engine_id, self.control.session)
        if self.slot.closing:
            raise UnavailableError("engine_id", f"the registration of {self.slot.engine_id!r} ended")

    # CompletionSink (the feed writes completions through these, on the loop or the data-plane thread)
    direct = True

    @property
    def writable(self) -> bool:
        return self.writer.writable

    @property
    def closed(self) -> bool:
        return self.writer.closed

    def send(self, completions: list) -> bool:
        return self.writer.write(encode_frame(pb.CompletionBatch(completions=completions).SerializeToString()))

    async def wait_writable(self) -> None:
        await self.writer.wait_writable()

    async def _send(self) -> None:
        """The engine's completions, in batches, until the session or the registration ends."""
        slot = self.slot
        try:
            await slot.completions.pump(self, COMPLETIONS_PER_BATCH, lambda: self.ended)
            if not self.ended:  # everything queued was sent; the engine learns no more will come
                raise UnavailableError("engine_id", f"the registration of {slot.engine_id!r} ended")
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._end_with(err)

    def _end_with(self, err: Exception) -> None:
        code, message = error_status(METHOD, err)
        self.daemon.metrics.rpc_errors.labels(METHOD, code.name).inc()
        if code in audit.SECURITY_CODES:  # a session that is not the engine's: who tried it
            audit.socket_refused("reads", self.uid, self.pid, code, message,
                                 engine_id=self.slot.engine_id if self.slot is not None else self.hello_engine_id)
        self.end(code, message)

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """The last frame (the status and why), then close once it is written."""
        if self.ended:
            return
        self.ended = True
        if self.slot is not None:
            self.slot.completions.detach(self)  # no completion from the data-plane thread after the end frame
            self.slot.completions.poke()  # the sender sees `ended` and stops taking completions
        end = pb.CompletionBatch(end_code=code.value[0], end_message=message[:1024])
        self.writer.write(encode_frame(end.SerializeToString()))
        self.writer.close_when_flushed(self.transport.close)
