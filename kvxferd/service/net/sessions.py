"""Engine sessions served by reader workers: the control plane's side (issue #55, docs/dataplane.md).

The control plane accepts the engine's reads socket and checks it (``SO_PEERCRED``, the registration's
session in the first batch: ``net/readsock.py``), then hands it over, so the engine's reads never pass
through this process::

    control plane                                                 the engine's reader worker
    session {engine_id, limits, ready links, feed?} ─────────────► takes the socket and the first batch
      + the socket (SCM_RIGHTS), the bytes read past the            (worker/sessionreads.py): admits,
        first batch (``pending``)                                   posts, polls, numbers and writes
                                                                    completions
    holds, renewals, releases (net/calls.py) ◄── session_calls ─── the engine's holds: the ledger is here
                                             ─── session_write ──► their answers, written in order
    peers.handshake                          ◄── need_handshake ── a read whose link is not ready waits
    RemoteLink.on_ready                      ─── link {ready} ───► (or handshake_failed)
    the link stale (re-handshaken soon)      ◄── link_stale ────── a read on it failed
    audit line, the link probed soon         ◄── capability_refused
    metrics (as ReadPath.done's)             ◄── session_stats ─── each pass's ended reads, reads in flight
    counted                                  ◄── session_closed

The feed of completions goes with the session (``CompletionFeed.hand_over``): the worker numbers on.
A worker that dies or is replaced takes it along; the engine reconnects (its session broke), the next
session goes to the next generation, and numbering goes on after the engine's ack; the reads that had
no completion are sent again by the engine. Anything the worker says is checked here as untrusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Protocol

from google.protobuf.message import DecodeError

from kvxferd.errors import KvxferError, NotFoundError, status_number
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base import audit
from kvxferd.service.base.metrics import READS_SOCKET_METHOD
from kvxferd.service.base.status import code_numbered
from kvxferd.wire.frames import MAX_SEQ
from kvxferd.service.engines.holding import release_hold
from kvxferd.service.net.calls import CallParts, answer_calls, check_calls
from kvxferd.service.reads.path import ReadPathParts
from kvxferd.wire import workerchannel as channel
from kvxferd.wire.frames import encode_frame
from kvxferd.xfer.handles import ReadFailure

if TYPE_CHECKING:
    from kvxferd.service.engines.slots import EngineSlot
    from kvxferd.service.net.framewriter import FrameWriter


class OpenedSession(Protocol):
    """A reads-socket session its first batch opened (``net/readsock.py``'s ReadSession)."""

    slot: EngineSlot
    transport: asyncio.Transport
    writer: FrameWriter

    def handed_over(self) -> None:
        """Let go of the socket without a word: the worker has its copy."""


class SessionParts(CallParts, ReadPathParts, Protocol):
    """What handing sessions over uses of the daemon (the daemon, through ``net/parts.py``'s view, gives it)."""

log = logging.getLogger("kvxferd.sessions")
MAX_HANDED_BYTES = 256 << 10  # a session message's unacked completions (hex); the whole message is checked too
HANDSHAKE_ASKS_S = 1.0  # a worker's asks for one link's handshake start one at most this often
FAILURES = {f.value: f for f in ReadFailure}
MAX_IN_FLIGHT = 1 << 20
WAIT_FOR_WORKER_S = 10.0  # a session opened while the engine's reader worker starts waits this long for it
WAIT_POLL_S = 0.02  # a worker's count of its reads in flight, believed up to this


class WorkerSessions:
    """Hands engine sessions to reader workers and answers what the workers ask (event loop)."""

    def __init__(self, daemon: SessionParts) -> None:
        self.daemon = daemon
        self._asked: dict[tuple[int, str], float] = {}  # (slot, remote engine) -> when its handshake was started

    # ---- the hand-over ------------------------------------------------------------------------
    def hand_over(self, session: OpenedSession, batch: pb.ReadBatch, payloads: list[bytes], leftover: bytes) -> bool:
        """Hand a reads session, at its first batch with reads (``payloads``: it and the batches after it
        that came with it; ``leftover``: a frame begun), to the engine's reader worker; False to serve it
        here (no reader worker, or it cannot take it now, or the option is off). An engine that only
        holds is never handed over: its holds are the control plane's anyway."""
        config, slot = self.daemon.config, session.slot
        reader = slot.reader_worker
        if reader is None or not config.reader_worker_sessions or slot.reads or slot.closing \
                or session.writer.num_buffered_bytes or not 0 <= batch.ack_seq < MAX_SEQ:
            return False  # (what this process wrote goes first: the next batch; a wild ack: refused here)
        generation = reader.supervisor.serving_generation
        # The first batch carries the registration's session (its proof on the control plane): it stays here.
        # The worker gets the batch without it; no later batch carries it.
        first = pb.ReadBatch()
        first.CopyFrom(batch)
        first.ClearField("session")
        pending = b"".join(encode_frame(p) for p in [first.SerializeToString(), *payloads[1:]]) + leftover
        if not generation:
            return False
        feed = slot.completions.hand_over(generation, batch.ack_seq)
        message = {"op": "session", "engine_id": slot.engine_id, "ack_seq": batch.ack_seq,
                   "limits": {"max_reads": config.max_reads_per_engine, "max_reads_per_batch": config.max_reads_per_batch,
                              "deadline_s": config.deadline_s, "max_deadline_s": config.max_deadline_s,
                              "max_frame_bytes": config.max_message_bytes},
                   "ready": [engine_id for engine_id, link in slot.links.items() if link.ready]}
        if feed is not None:
            message["feed"] = {"last_seq": feed[0], "unacked": [c.SerializeToString().hex() for c in feed[1]]}
        if sum(len(c) for c in message.get("feed", {}).get("unacked", ())) > MAX_HANDED_BYTES:
            return False  # (thousands of unacked completions: served here, and handed over next time)
        fields, blob_fds = channel.blob_fields(pending, "pending", fd_index=1)
        message.update(fields)
        try:
            if len(json.dumps(message)) > channel.MAX_MESSAGE_BYTES:
                return False
            # To the generation the feed was made for (a replacement may be published meanwhile: it would
            # get a session without the feed it needs).
            sent = reader.supervisor.send_to(generation, message,
                                             [session.transport.get_extra_info("socket").fileno(), *blob_fds])
        finally:
            channel.close_all(blob_fds)
        if not sent:
            return False
        if slot.completions.worker_generation != generation:
            slot.worker_reads_in_flight = 0  # (the last generation's count: its reads went with it)
        slot.completions.handed(generation, feed[0] if feed is not None else 0)
        session.handed_over()
        self.daemon.metrics.sessions_handed.inc()
        log.debug("reads session handed to the reader worker", extra={"engine_id": slot.engine_id, "generation": sent})
        return True

    def worker_starting(self, slot: EngineSlot) -> bool:
        """The slot has a reader worker that is not serving now (started again after a death, say) and
        sessions would go to it: worth waiting for (:meth:`wait_for_worker`)."""
        reader = slot.reader_worker
        return (reader is not None and self.daemon.config.reader_worker_sessions and not slot.closing
                and not reader.supervisor.serving_generation and not reader.supervisor.failure)

    async def wait_for_worker(self, engine_id: str) -> None:
        """Until the engine's reader worker serves (or WAIT_FOR_WORKER_S passed, or the registration ended)."""
        deadline = asyncio.get_running_loop().time() + WAIT_FOR_WORKER_S
        while asyncio.get_running_loop().time() < deadline:
            slot = self.daemon.registry.slots.get(engine_id)
            if slot is None or not self.worker_starting(slot):
                return
            await asyncio.sleep(WAIT_POLL_S)

    # ---- what the worker says ---------------------------------------------------------------------
    def on_event(self, slot: EngineSlot, message: dict) -> None:
        """One event of the worker serving ``slot``'s session (checked: it is untrusted)."""
        reader = slot.reader_worker
        if reader is None:
            return
        reader.session_event_taken()
        if self.daemon.registry.slots.get(slot.engine_id) is not slot:
            return
        try:
            op = message["op"]
            if op == "session_calls":
                self._calls(slot, reader, message)
            elif op == "session_stats":
                self._stats(slot, message)
            elif op == "need_handshake":
                self._need_handshake(slot, reader, str(message.get("engine_id"))[:256])
            elif op == "link_stale":
                link = slot.links.get(str(message.get("engine_id")))
                if link is not None:
                    link.stale = True  # handshaken again by the probes before long, or by the next read's ask
            elif op == "capability_refused":
                link = slot.links.get(str(message.get("engine_id")))
                if link is not None:
                    audit.capability_refused(slot.engine_id, link.remote_engine_id,
                                             str(message.get("remote_request_id"))[:256], "sealed by a registration "
                                             "of the remote engine that this daemon's handshake does not know")
                    self.daemon.probe_soon(slot, link)
            elif op == "session_closed":
                code = message.get("code")
                if isinstance(code, int) and 0 < code < 17:
                    self.daemon.metrics.rpc_errors.labels(READS_SOCKET_METHOD, code_numbered(code).name).inc()
        except (KvxferError, ValueError, TypeError, KeyError) as err:
            log.warning("a reader worker's session event was refused", extra={"engine_id": slot.engine_id,
                                                                              "error": str(err)[:300]})

    def _calls(self, slot: EngineSlot, reader, message: dict) -> None:
        """Holds, renewals and releases from the engine's session: done here, answered through the worker."""
        try:
            batch = pb.ReadBatch.FromString(bytes.fromhex(str(message.get("frame"))))
        except (ValueError, DecodeError):
            return  # not the engine's: the worker made it up
        if batch.reads or batch.ack_seq or batch.control:
            return
        try:
            check_calls(self.daemon, slot, batch, True)
        except KvxferError as err:
            reader.supervisor.send_to(message.get("generation", 0),
                                      {"op": "session_end", "code": status_number(err), "message": str(err)[:1024]})
            return
        generation = message.get("generation", 0)
        for payload in answer_calls(self.daemon, slot, batch):
            if not reader.supervisor.send_to(generation, {"op": "session_write", "frame": payload.hex()}):
                # The answer cannot reach the engine (the worker's channel is full, or it is gone): a hold
                # it never learns of would pin its blocks until the lease ends. Released now.
                answered = pb.CompletionBatch.FromString(payload)
                for answer in answered.holds:
                    if not answer.code:
                        try:
                            release_hold(self.daemon, slot, answer.request_id)
                        except KvxferError:
                            pass

    def _stats(self, slot: EngineSlot, message: dict) -> None:
        """The ended reads of a worker's pass, in the metrics the control plane's own reads feed."""
        m = self.daemon.metrics
        in_flight = message.get("in_flight")
        if isinstance(in_flight, int) and 0 <= in_flight <= MAX_IN_FLIGHT:
            slot.worker_reads_in_flight = in_flight
        reads = message.get("reads")
        for entry in reads if isinstance(reads, list) else ():
            if not (isinstance(entry, list) and len(entry) == 8):
                continue
            ok, failure, duration_s, num_bytes, num_descriptors, host_copies, post_s, unsettled = entry
            failure = FAILURES.get(str(failure), ReadFailure.TRANSFER)
            if failure is ReadFailure.REFUSED:
                m.read_failures.labels(failure.value).inc()
                continue
            if not all(isinstance(v, (int, float)) and 0 <= v < 1 << 50
                       for v in (duration_s, num_bytes, num_descriptors, host_copies, post_s)):
                continue
            m.read_duration.labels("ok" if ok is True else "failed").observe(duration_s)
            if post_s:
                m.read_post.observe(post_s)
            m.read_descriptors.observe(num_descriptors)
            m.read_bytes.inc(num_bytes)
            if host_copies:
                m.same_host_copies.inc(host_copies)
            if unsettled is True:
                m.unsettled_reads.inc()
            if ok is not True:
                m.read_failures.labels(failure.value).inc()
                if failure is ReadFailure.STALE:
                    m.stale_reads.inc()

    def _need_handshake(self, slot: EngineSlot, reader, engine_id: str) -> None:
        """A read waits for the link to ``engine_id``: its handshake (joined if one runs), then ``link``; a
        link this engine never handshook refuses the read, as the control plane's own path does."""
        link = slot.links.get(engine_id)
        if link is None or link.remote is None:
            err = NotFoundError("remote_engine_id", f"no handshake with {engine_id!r} yet")
            reader.supervisor.send({"op": "handshake_failed", "engine_id": engine_id, "error": str(err),
                                    "refused_code": status_number(err)})
            return
        if link.ready:
            reader.link_ready(engine_id, True)
            return
        key, now = (id(slot), engine_id), time.monotonic()
        if now - self._asked.get(key, -HANDSHAKE_ASKS_S) < HANDSHAKE_ASKS_S:
            return  # one started lately: its answer comes (the worker asks again while its reads wait)
        self._asked[key] = now
        if len(self._asked) > 4 * len(self.daemon.registry.slots) * 1024:
            self._asked = {k: t for k, t in self._asked.items() if now - t < HANDSHAKE_ASKS_S}
        self.daemon.spawn(self._handshake(slot, reader, engine_id))

    async def _handshake(self, slot: EngineSlot, reader, engine_id: str) -> None:
        try:
            await asyncio.wait_for(self.daemon.peers.handshake(slot, engine_id), self.daemon.config.max_deadline_s)
        except (KvxferError, asyncio.TimeoutError) as err:
            reader.supervisor.send({"op": "handshake_failed", "engine_id": engine_id,
                                    "error": str(err)[:1000] or "timed out", "refused_code": 0})
            return
        link = slot.links.get(engine_id)
        if link is not None and link.ready:
            reader.link_ready(engine_id, True)

    def drain(self) -> None:
        """The daemon drains for shutdown: every worker's session refuses new reads."""
        for slot in list(self.daemon.registry.slots.values()):
            reader = slot.reader_worker
            if reader is not None:
                reader.supervisor.send({"op": "accepting", "accepting": False})
