"""The reads of the engine's session, in its reader worker: batch in, completions out, no hop to the daemon.

::

    engine batch (SessionSocket)       this worker                                   control plane (told,
    ──────────────────────────         ───────────                                   never asked first)
    ReadBatch{ack_seq, reads} ───────► the session's rules (as service/reads/path.py's)
                                       ├ link ready: admitted on its connection (bad ids and capabilities
                                       │   no holder sealed: refused before any I/O), posted, polled here
                                       └ not ready: parked ───────────────────────►  need_handshake {engine_id}
                                            ◄── link {engine_id, ready} / handshake_failed {engine_id, ..}
    ReadBatch{holds, renewals, ──────────────────────────────────────────────────►  session_calls {frame}
              releases}                ◄── session_write {frame}: their answers, written here in order
    ◄── CompletionBatch{completions}   numbered here (SessionFeed); then     ─────►  session_stats, and the
                                       a failed read's link turns stale here ────►  notices its reads made
                                                                                     (sent from the holder
                                                                                     worker's notice agent)

The control plane keeps what only it may know: links, handshakes, holds,
metrics, notices' sender. A read never waits for it unless its link must
be handshaken again (as on the control plane's own path).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from kvxferd.errors import (INTERNAL_NUMBER, InvalidArgumentError, KvxferError, PermissionDeniedError,
                            ResourceExhaustedError, UnavailableError, status_number)
from kvxferd.plan.capability import sealed_by_other_keys
from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire import workerchannel as channel
from kvxferd.wire.messages import check_id, check_seconds, has_calls, ids_to_pb, read_request_from_spec
from kvxferd.wire.frames import MAX_SEQ
from kvxferd.worker.session import SessionFeed, SessionGone, SessionSocket, completion_batches
from kvxferd.xfer.admission import admit, check_ids
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.records import InFlightRead, ReadResult

STALE_LINK_FAILURES = frozenset({ReadFailure.TRANSFER, ReadFailure.REMOTE_GONE, ReadFailure.DEADLINE})
MAX_RECEIVES_PER_PASS = 16
STATS_EVERY_S = 0.02  # a session's figures go to the control plane at most this often
END_WRITE_S = 0.2  # how long a session's last frame may take to write (a cut frame would read as a break)
ASK_AGAIN_S = 1.0  # a need_handshake not answered (its message lost to a full channel) is sent again after this
MAX_PENDING_BYTES = 64 << 20  # what the control plane read past the first batch (a frame's worth at most)
MAX_CALLS_BYTES = 400 << 10  # holds, renewals and releases in one message to the control plane (hex: 800 KiB)
ABORTED_CODE = 10  # gRPC ABORTED: the session an engine's newer one replaced


@dataclass(frozen=True)
class Limits:
    """The daemon's limits on one engine's session, as its configuration says (sent with the session)."""

    max_reads: int
    max_reads_per_batch: int
    deadline_s: float
    max_deadline_s: float
    max_frame_bytes: int

    @classmethod
    def of(cls, message: dict) -> Limits:
        values = message.get("limits")
        if not isinstance(values, dict):
            raise InvalidArgumentError("limits", "an object")
        ints = {k: values.get(k) for k in ("max_reads", "max_reads_per_batch", "max_frame_bytes")}
        floats = {k: values.get(k) for k in ("deadline_s", "max_deadline_s")}
        if not all(isinstance(v, int) and 0 < v <= 1 << 30 for v in ints.values()) or \
                not all(isinstance(v, (int, float)) and 0 < v <= 86400 for v in floats.values()):
            raise InvalidArgumentError("limits", "positive, bounded numbers")
        return cls(**ints, **floats)


@dataclass(eq=False)
class SessionRead:
    """One read of the session, from its batch to its completion."""

    request: ReadRequest
    remote_engine_id: str
    received_s: float  # perf_counter, when its batch came
    deadline_s: float  # perf_counter
    inflight: InFlightRead | None = None  # None: parked until its link is ready
    queued_s: float = 0.0  # admitted, posting began
    posted_s: float = 0.0


class SessionReads:
    """The engine's session and its reads (the worker's thread only)."""

    def __init__(self, executor, notices, tell: Callable[[dict, Sequence[int]], None]) -> None:
        """``notices``: what the executor's reads would notify (worker/reads.py's NoticeCollector); ``tell``:
        a one-way message (and fds) to the control plane."""
        self.executor, self.notices, self.tell = executor, notices, tell
        self.engine_id = ""
        self.limits: Limits | None = None
        self.socket: SessionSocket | None = None
        self.feed: SessionFeed | None = None
        self.reads: dict[str, SessionRead] = {}  # request id -> its read, parked or posted
        self.ready: set[str] = set()  # remote engines whose link the control plane says is ready
        self.asked: dict[str, float] = {}  # remote engine id -> when need_handshake went (monotonic)
        self.accepting = True
        self._out: list[pb.Completion] = []  # numbered, to write at the end of this pass
        self._stats: list[list] = []
        self._told_in_flight = 0
        self._told_s = -STATS_EVERY_S

    @property
    def busy(self) -> bool:
        """Reads in flight: poll again soon."""
        return bool(self.reads)

    def figures_due_in_s(self) -> float | None:
        """When figures not told yet are due (seconds from now, the worker's longest sleep), or None."""
        if not self._stats and len(self.reads) == self._told_in_flight:
            return None
        return max(0.0, self._told_s + STATS_EVERY_S - time.monotonic())

    # ---- commands of the control plane ---------------------------------------------------
    def adopt(self, message: dict, fds: Sequence[int]) -> None:
        """A session the control plane authenticated (``session {engine_id, limits, feed?, pending}`` and
        the socket's fd): it replaces any before it, which ends ABORTED."""
        engine_id = check_id(str(message.get("engine_id", "")), "engine_id")
        if self.engine_id and engine_id != self.engine_id:
            raise InvalidArgumentError("engine_id", f"this worker reads for {self.engine_id!r}")
        limits = Limits.of(message)
        pending = channel.blob_of(message, "pending", fds, MAX_PENDING_BYTES)
        ready = message.get("ready")
        if not isinstance(ready, list) or not all(isinstance(r, str) for r in ready):
            raise InvalidArgumentError("ready", "a list of remote engine ids")
        feed = message.get("feed")
        if isinstance(feed, dict):  # the control plane's feed (the first session here, or after a rebase)
            last_seq = feed.get("last_seq")
            if not isinstance(last_seq, int) or not 0 <= last_seq < MAX_SEQ:
                raise InvalidArgumentError("feed.last_seq", "a non-negative integer below 2**62")
            try:
                unacked = [pb.Completion.FromString(bytes.fromhex(str(c))) for c in _list(feed.get("unacked"))]
            except (ValueError, DecodeError):
                raise InvalidArgumentError("feed.unacked", "Completion messages, hex") from None
            new_feed = SessionFeed(last_seq, unacked)
        elif self.feed is None:  # (sent to another generation, raced by a replacement): on from the engine's ack
            ack_seq = message.get("ack_seq")
            if not isinstance(ack_seq, int) or not 0 <= ack_seq < MAX_SEQ:
                raise InvalidArgumentError("ack_seq", "the session's first ack, below 2**62")
            new_feed = SessionFeed(ack_seq)
        else:
            new_feed = self.feed
        sock = socket.socket(fileno=_dup(fds[0] if fds else -1))  # (last: nothing above can leak it)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.close()
            raise InvalidArgumentError("session", "a UNIX stream socket")
        self.feed = new_feed
        if self.socket is not None:
            self._end_session(ABORTED_CODE, "engine_id: a newer session of this engine took over", tell=False)
        self.engine_id, self.limits, self.ready = engine_id, limits, set(ready)
        self.socket = SessionSocket(sock, limits.max_frame_bytes, pending)
        for payload in self.feed.batches():  # every unacked completion again: the engine drops what it has
            self._write(payload)
        self.on_readable()  # the first batch, which the control plane read

    def link(self, engine_id: str, ready: bool) -> None:
        """The control plane's link to ``engine_id`` turned ready (its handshake is done) or stale."""
        if not ready:
            self.ready.discard(engine_id)
            return
        self.ready.add(engine_id)
        self.asked.pop(engine_id, None)
        for read in [r for r in self.reads.values() if r.inflight is None and r.remote_engine_id == engine_id]:
            self._start(read)
        self.flush()

    def handshake_failed(self, engine_id: str, error: str, refused_code: int) -> None:
        """The handshake a parked read waited for failed: each fails (or is refused: no such link)."""
        self.asked.pop(engine_id, None)
        for read in [r for r in self.reads.values() if r.inflight is None and r.remote_engine_id == engine_id]:
            if refused_code:
                del self.reads[read.request.request_id]
                self._refused(read.request.request_id, refused_code, error)
            else:
                self._end_unposted(read, f"handshake: {error}", ReadFailure.HANDSHAKE)
        self.flush()

    def reconnecting(self, engine_id: str) -> None:
        """A new connection to ``engine_id`` replaces the current one: reads on it end (as the control
        plane's handshake fails them), once UCX let go of their transfers."""
        self.ready.discard(engine_id)
        for read in self.reads.values():
            if read.inflight is not None and read.remote_engine_id == engine_id and read.inflight.drain is None:
                self.executor.abort(read.inflight, "the remote engine was re-handshaked (restarted or unreachable)",
                                    ReadFailure.ABORTED, drain=True)
        self.flush()  # (the notices an abort made go now: the channel's next command must not take them)

    def write_frame(self, payload: bytes) -> None:
        """A frame of the control plane's for the engine (answers to its holds), after what was sent before."""
        if self.socket is not None:
            self._write(payload)

    def end(self, code: int, message: str) -> None:
        """The control plane ends the session (the registration ended, the daemon stops)."""
        if self.socket is not None:
            self._end_session(code, message, tell=False)

    def drop(self) -> None:
        """The control plane gives the session to another generation (this one was replaced) or serves it
        itself: closed without a word (the client opens it again there, sending the reads without a
        completion again), and every read of it aborted (none may land after the engine moved on)."""
        for read in list(self.reads.values()):
            if read.inflight is None:
                del self.reads[read.request.request_id]
            elif read.inflight.drain is None:
                self.executor.abort(read.inflight, "the session went to another reader", ReadFailure.ABORTED,
                                    drain=True)
        if self.socket is not None:
            self._end_session(0, "", tell=False)
        self.flush()

    # ---- the engine's side ------------------------------------------------------------------
    def on_readable(self) -> None:
        """Take what the engine sent: its batches, in order. A batch that breaks the session's rules ends
        it with the status an engine gets from the control plane."""
        sock = self.socket
        if sock is None or sock.ending:
            return
        received_s = time.perf_counter()
        try:
            for _ in range(MAX_RECEIVES_PER_PASS):  # then the reads' progress: a flood does not starve it
                payloads = sock.receive()
                for payload in payloads:
                    try:
                        batch = pb.ReadBatch.FromString(payload)
                    except DecodeError:
                        raise InvalidArgumentError("frame", "not a ReadBatch") from None
                    self.take_batch(batch, received_s)
                if not payloads and not sock.has_pending:
                    break
        except SessionGone:
            self._end_session(0, "", tell=True)
        except KvxferError as err:
            self._end_session(status_number(err), str(err), tell=True)
        except Exception as err:  # noqa: BLE001 - a batch this code did not foresee ends its session, not the worker
            self._end_session(INTERNAL_NUMBER, f"the reader worker could not take a batch ({type(err).__name__})",
                              tell=True)
        self.flush()

    def take_batch(self, batch: pb.ReadBatch, received_s: float) -> None:
        """One batch: its ack, each read started or refused, then its calls sent to the control plane."""
        limits, feed = self.limits, self.feed
        if batch.control:
            raise InvalidArgumentError("control", "only a session's first batch opens a control session")
        if batch.engine_id and batch.engine_id != self.engine_id:
            raise InvalidArgumentError("engine_id", f"this session belongs to {self.engine_id!r}")
        if len(batch.reads) > limits.max_reads_per_batch:
            raise InvalidArgumentError("reads", f"{len(batch.reads)} reads in one batch, the limit is "
                                                f"{limits.max_reads_per_batch} (max_reads_per_batch)")
        feed.ack(batch.ack_seq)
        for spec in batch.reads:
            if spec.resend and (spec.request_id in self.reads or feed.has(spec.request_id)):
                continue  # the first send arrived; its completion is on its way
            try:
                self._submit(spec, received_s)
            except KvxferError as err:
                if len(self.reads) + len(feed) >= 2 * limits.max_reads:
                    raise ResourceExhaustedError("max_reads_per_engine", "the engine does not read its "
                                                 "completions (reconnect and ack them)") from None
                self._refused(spec.request_id, status_number(err), str(err))
        if has_calls(batch):
            if (batch.holds or batch.renewals) and not self.socket.writable:
                raise ResourceExhaustedError("holds", "the session does not read the answers to its holds")
            self._send_calls(batch)

    def _send_calls(self, batch: pb.ReadBatch) -> None:
        """The batch's holds, renewals and releases to the control plane, in order: in one message, or one
        message per call when together they are more than a message carries (a worker hands no fd over)."""
        calls = pb.ReadBatch(holds=batch.holds, renewals=batch.renewals, releases=batch.releases,
                             final_layers=batch.final_layers)
        payload = calls.SerializeToString()
        if len(payload) > MAX_CALLS_BYTES:
            singles = ([pb.ReadBatch(holds=[h]) for h in batch.holds] + [pb.ReadBatch(renewals=[r]) for r in batch.renewals]
                       + [pb.ReadBatch(final_layers=[f]) for f in batch.final_layers]
                       + [pb.ReadBatch(releases=[r]) for r in batch.releases])
            payloads = [single.SerializeToString() for single in singles]
            if max(len(p) for p in payloads) > MAX_CALLS_BYTES:
                raise ResourceExhaustedError("holds", f"a hold of more than {MAX_CALLS_BYTES} bytes: send it on "
                                                      "a control session")
        else:
            payloads = [payload]
        for payload in payloads:
            self.tell({"op": "session_calls", "frame": payload.hex()}, ())

    def _submit(self, spec: pb.ReadSpec, received_s: float) -> None:
        limits = self.limits
        if not self.accepting:
            raise UnavailableError("engine_id", "the daemon is draining for shutdown")
        earlier = self.reads.get(spec.request_id)
        if earlier is not None:
            raise InvalidArgumentError("request_id", f"request {spec.request_id!r} is already in flight")
        if len(self.reads) + len(self.feed) >= limits.max_reads:
            raise ResourceExhaustedError("max_reads_per_engine", f"{limits.max_reads} reads are in flight or "
                                                                 "not acked yet")
        check_id(spec.remote_engine_id, "remote_engine_id")
        request = read_request_from_spec(spec)
        deadline_s = received_s + check_seconds(spec.deadline_s, "deadline_s", default_s=limits.deadline_s,
                                                max_s=limits.max_deadline_s)
        read = self.reads[request.request_id] = SessionRead(request, spec.remote_engine_id, received_s, deadline_s)
        if spec.remote_engine_id in self.ready:
            self._start(read)
        else:
            self._park(read)

    def _park(self, read: SessionRead) -> None:
        """Wait for the link's handshake (asked for once a second at most, while reads wait for it: an
        answer lost to a full channel is asked for again)."""
        engine_id = read.remote_engine_id
        now = time.monotonic()
        if now - self.asked.get(engine_id, -ASK_AGAIN_S) >= ASK_AGAIN_S:
            self.asked[engine_id] = now
            self.tell({"op": "need_handshake", "engine_id": engine_id}, ())

    def _start(self, read: SessionRead) -> None:
        """Admit and post a read whose link is ready; refused (bad ids, a capability no holder sealed:
        nothing posted) or failed (its connection gone) as a completion."""
        ex, request = self.executor, read.request
        try:
            remote = ex.remote(read.remote_engine_id)
        except KvxferError:  # no connection here (it went with a replaced generation): the link is stale
            self.ready.discard(read.remote_engine_id)
            self.tell({"op": "link_stale", "engine_id": read.remote_engine_id}, ())
            self._park(read)  # (the control plane takes link_stale first: its handshake connects this worker)
            return
        try:
            if sealed_by_other_keys(remote.hold_keys, request.remote_capabilities):
                check_ids(remote, request)  # bad ids first, as on the control plane
                self.tell({"op": "capability_refused", "engine_id": read.remote_engine_id,
                           "remote_request_id": request.remote_request_id}, ())
                raise PermissionDeniedError("remote_capabilities", "sealed by a registration of the remote engine "
                                            "that this daemon's handshake does not know (a restarted holder is "
                                            "picked up within a second)")
            admitted = admit(remote, request)
        except KvxferError as err:
            del self.reads[request.request_id]
            self._refused(request.request_id, status_number(err), str(err))
            return
        read.queued_s = time.perf_counter()
        if read.queued_s >= read.deadline_s:
            self._end_unposted(read, "deadline: it passed before the read could be posted", ReadFailure.DEADLINE)
            return
        try:
            read.inflight = ex.post(admitted, read.received_s, notify=True)
        except KvxferError as err:
            self._end_unposted(read, str(err), ReadFailure.REMOTE_GONE)
            return
        read.posted_s = read.inflight.posted_s
        self._poll(read, read.queued_s)

    # ---- progress -----------------------------------------------------------------------------
    def progress(self) -> None:
        """Advance every read (deadlines: aborted here, the engine was promised an answer by then); write
        what ended; tell the control plane its figures and the notices to send."""
        now = time.perf_counter()
        for read in list(self.reads.values()):
            if read.inflight is None:
                if now >= read.deadline_s:
                    self._end_unposted(read, "deadline: the re-handshake did not finish in time", ReadFailure.DEADLINE)
                else:
                    self._park(read)
            else:
                try:
                    self._poll(read, now)
                except Exception as err:  # noqa: BLE001 - one read's surprise fails that read, not the worker
                    if read.request.request_id in self.reads and read.inflight.result is None:
                        self.executor.abort(read.inflight, f"the reader worker failed it: {type(err).__name__}",
                                            ReadFailure.TRANSFER, drain=False)
                        self._end_unposted(read, f"the reader worker failed it: {type(err).__name__}",
                                           ReadFailure.TRANSFER)
        self.flush()

    def _poll(self, read: SessionRead, now: float) -> None:
        ex, inflight = self.executor, read.inflight
        result = ex.poll(inflight, notify=True)
        if result is None and now >= read.deadline_s and inflight.drain is None:
            result = ex.abort(inflight, "deadline: the transfer or its board check did not end in time",
                              ReadFailure.DEADLINE)
        if result is not None:
            self._ended(read, result)

    def _ended(self, read: SessionRead, result: ReadResult) -> None:
        del self.reads[read.request.request_id]
        ended_s, inflight = time.perf_counter(), read.inflight
        transferred_s = inflight.transferred_s or ended_s
        completion = pb.Completion(
            request_id=result.request_id, ok=result.ok, num_bytes=result.num_bytes,
            num_descriptors=result.num_descriptors, duration_s=ended_s - read.received_s,
            invalid_block_ids=[] if result.ok else ids_to_pb(result.invalid_block_ids), error=result.error or "",
            post_s=read.posted_s - read.received_s, done_unix_s=time.time(), failed_ranks=result.failed_ranks,
            plan_s=read.queued_s - read.received_s, transfer_s=transferred_s - read.posted_s,
            check_s=ended_s - transferred_s, failure="" if result.ok else (result.failure or ReadFailure.TRANSFER).value)
        self._out.append(self.feed.put(completion))
        self._stats.append([result.ok, result.failure.value, completion.duration_s, result.num_bytes,
                            result.num_descriptors, inflight.num_host_copies, completion.post_s, result.unsettled])
        if not result.ok and result.failure in STALE_LINK_FAILURES and read.remote_engine_id in self.ready:
            self.ready.discard(read.remote_engine_id)  # the next read waits for a new handshake
            self.tell({"op": "link_stale", "engine_id": read.remote_engine_id}, ())

    def _end_unposted(self, read: SessionRead, error: str, failure: ReadFailure) -> None:
        """Failed with nothing posted: every local block it names is invalid (the engine recomputes)."""
        del self.reads[read.request.request_id]
        invalid = [np.unique(np.asarray(ids, dtype=np.int64)) for ids in read.request.local_block_ids]
        completion = pb.Completion(request_id=read.request.request_id, ok=False, error=error,
                                   invalid_block_ids=ids_to_pb(invalid), duration_s=time.perf_counter() - read.received_s,
                                   done_unix_s=time.time(), failure=failure.value)
        self._out.append(self.feed.put(completion))
        self._stats.append([False, failure.value, completion.duration_s, 0, 0, 0, 0.0, False])

    def _refused(self, request_id: str, code: int, error: str) -> None:
        """A read refused with nothing posted or written: ``refused_code`` says why."""
        self._out.append(self.feed.put(pb.Completion(request_id=request_id, ok=False, error=error,
                                                     refused_code=code, done_unix_s=time.time(),
                                                     failure=ReadFailure.REFUSED.value)))
        self._stats.append([False, ReadFailure.REFUSED.value, 0.0, 0, 0, 0, 0.0, False])

    def flush(self) -> None:
        """Write the completions of this pass, then tell the control plane about them."""
        if self._out:
            out, self._out = self._out, []
            if self.socket is not None:
                for payload in completion_batches(out):
                    self._write(payload)
        notices = self.notices.take()
        for start in range(0, len(notices), channel.MAX_NOTICES):
            self.tell({"op": "session_notices", "notices": notices[start:start + channel.MAX_NOTICES]}, ())
        # Figures at most every STATS_EVERY_S (a message per pass at 1 000 reads/s cost the control plane's
        # loop a wake each); the count in flight with them (the control plane drains by it).
        due = (self._stats or len(self.reads) != self._told_in_flight) and \
            time.monotonic() - self._told_s >= STATS_EVERY_S
        if due:
            self._told_s = time.monotonic()
            stats, self._stats, self._told_in_flight = self._stats, [], len(self.reads)
            for start in range(0, max(len(stats), 1), 1024):
                self.tell({"op": "session_stats", "reads": stats[start:start + 1024], "in_flight": len(self.reads)},
                          ())

    def on_writable(self) -> None:
        if self.socket is not None:
            try:
                self.socket.flush()
            except SessionGone:
                self._end_session(0, "", tell=True)

    def _write(self, payload: bytes) -> None:
        try:
            self.socket.write(payload)
        except SessionGone:
            self._end_session(0, "", tell=True)

    def _end_session(self, code: int, message: str, *, tell: bool) -> None:
        """The end frame (with a code) then close, or close at once; the feed stays for the next session."""
        sock, self.socket = self.socket, None
        if sock is None:
            return
        if code:
            try:
                sock.end(code, message)
                if not sock.closed:  # its last frame waits in the buffer: written whole, within END_WRITE_S
                    sock.sock.settimeout(END_WRITE_S)
                    sock.sock.sendall(sock.out)
            except (SessionGone, OSError):
                pass
        sock.close()
        if tell:
            self.tell({"op": "session_closed", "code": code, "message": message[:500]}, ())

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None


def _dup(fd: int) -> int:
    """A copy of the session's fd (the one that came with the message is closed by the caller)."""
    if fd < 0:
        raise InvalidArgumentError("session", "the session's socket comes with the message")
    return os.dup(fd)


def _list(value) -> list:
    if not isinstance(value, list):
        raise InvalidArgumentError("feed.unacked", "a list")
    return value
