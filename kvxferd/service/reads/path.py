"""The read path on the event loop: a read from the engine's submit to its completion.

::

    submit (one ReadSpec of a Reads batch, from the reads socket or the gRPC stream)
      checks: draining? duplicate id? too many reads in flight? handshake done?
      ─► a batch's read over what the batch may still post here (max_read_bytes, a bound):
         handed to the data-plane thread unplanned; it plans (bad ids: refused there, before
         any I/O, as the read's completion) and posts
      plan once (vectorised: bad ids fail here, before any I/O)
      ─► small (the batch's reads posted here stay within INLINE_MAX_BYTES): posted here on
         the loop; ended within the post (host memory) -> its completion at once, then the
         holders' notices, else the data-plane thread polls it
      ─► link stale: re-handshake, plan again, post
    an ok read that ended on the data-plane thread, its engine on the reads socket:
      ─► Completion numbered, queued and written by that thread (Read.complete)
    done (a list per data-plane round, one hop back to the loop)
      a failed transfer marks the link stale (the next read re-handshakes)
      ─► Completion numbered and queued on the engine's feed (on the reads socket also
         written at once), unless the thread wrote it; then the metrics

A read refused in a ``Reads`` batch becomes a completion too (``refused_code``),
so the engine learns about every read it sent on the same stream. The read
itself, its states and who may advance it: service/engines/read.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from kvxferd.errors import (InvalidArgumentError, KvxferError, NotFoundError, PermissionDeniedError,
                            ResourceExhaustedError, UnavailableError)
from kvxferd.plan.capability import sealed_by_other_keys
from kvxferd.service.base import audit
from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.dataplane.thread import INLINE_MAX_BYTES
from kvxferd.service.engines.read import Read, ReadState, refused_completion
from kvxferd.service.engines.slots import EngineSlot
from kvxferd.service.reads.expect import ExpectPath
from kvxferd.wire.messages import check_seconds, read_request_from_spec
from kvxferd.wire.tracecontext import check_traceparent
from kvxferd.xfer.admission import admit, check_ids
from kvxferd.xfer.handles import ReadFailure

if TYPE_CHECKING:
    from kvxferd.service.base.config import DaemonConfig
    from kvxferd.service.base.metrics import Metrics
    from kvxferd.service.base.spans import DaemonSpans
    from kvxferd.service.dataplane.thread import DataPlane
    from kvxferd.service.engines.registry import Registry
    from kvxferd.service.peers.links import Peers, RemoteLink


class ReadPathParts(Protocol):
    """What the read path uses of the daemon (the daemon, through ``net/parts.py``'s view, gives it)."""

    config: DaemonConfig
    metrics: Metrics
    spans: DaemonSpans
    registry: Registry
    dataplane: DataPlane
    peers: Peers

    def spawn(self, coro) -> asyncio.Task:
        """Run a coroutine in the background, cancelled at shutdown."""

    def probe_soon(self, slot: EngineSlot, link: RemoteLink) -> None:
        """Ask the remote engine's ranks for their incarnations soon (rate-limited per link)."""

    def wake_maintenance(self) -> None:
        """Something to expire appeared: back to the short maintenance tick now."""

    def publish(self, slot: EngineSlot, end) -> None:
        """Publish a hold's end on the notify bus (event-loop thread)."""

STALE_LINK_FAILURES = frozenset({ReadFailure.TRANSFER, ReadFailure.REMOTE_GONE, ReadFailure.DEADLINE})


class ReadPath:
    """Submits reads and turns finished ones into completions."""

    def __init__(self, daemon: ReadPathParts) -> None:
        self.daemon = daemon
        self.expects = ExpectPath(daemon, self.done)  # push, decode side (issue #57)
        self._inline_left = INLINE_MAX_BYTES  # bytes the current batch may still post on the loop
        # Each read observes one of these: looked up once (labels() takes a lock and a dict walk per call).
        self._durations = {ok: daemon.metrics.read_duration.labels("ok" if ok else "failed") for ok in (True, False)}

    def begin_batch(self) -> None:
        """A new ``Reads`` batch: it may post up to INLINE_MAX_BYTES on the
        event loop in all, so a batch of many small reads blocks the loop for one small copy at most."""
        self._inline_left = INLINE_MAX_BYTES

    def submit(self, slot: EngineSlot, remote_engine_id: str, request: ReadRequest, deadline_s: float,
               received_s: float, traceparent: str = "") -> None:
        """Check, plan and hand a read to the data plane; raises a typed error when refused (nothing posted).

        A read larger than the batch may still post here is planned on the
        data-plane thread instead, so the loop hands it over at once; bad ids
        are refused there, before any I/O, as the read's completion.
        """
        daemon = self.daemon
        config = daemon.config
        daemon.registry.check_accepting()
        earlier = slot.reads.get(request.request_id)
        if earlier is not None and earlier.state is not ReadState.DELIVERED:
            raise InvalidArgumentError("request_id", f"request {request.request_id!r} is already in flight")
        limit = config.max_reads_per_engine
        if len(slot.reads) + len(slot.completions) >= limit:
            raise ResourceExhaustedError("max_reads_per_engine", f"{limit} reads are in flight or not acked yet")
        if config.require_digests and not request.remote_digests:
            raise UnavailableError("remote_digests", "this daemon checks every read against its holds' digests "
                                   "(require_digests): send them (the connector's verify_share 1 on the prefill side)")
        link = slot.links.get(remote_engine_id)
        if link is None or link.remote is None:
            raise NotFoundError("remote_engine_id", f"no handshake with {remote_engine_id!r} yet")
        deadline_at_s = received_s + check_seconds(deadline_s, "deadline_s", default_s=config.deadline_s,
                                                   max_s=config.max_deadline_s)
        # Planning costs the loop 0.1-0.3 ms on cold caches. Two daemons woken by one engine step often land
        # on one core: the second waits for the first's loop, not for its copy (docs/benchmarks.md).
        plan_there = link.ready and link.remote.plan.max_read_bytes(request) > self._inline_left
        # Admitted here (xfer/admission.py): bad ids fail first, naming them; then only blocks the holders
        # sealed for this request pass, with nothing posted. A large read is sealed here and planned there
        # (bad ids: a refusal). Capabilities of a holder registration this link does not know (a restarted
        # holder, or made up) are refused too, and the link is probed soon: a real restart is picked up by
        # that probe. A link being re-handshaken may be about to learn a new key: such a read is admitted
        # when it is posted, on the new link, and renews no hold while it waits (it is not verified yet).
        verified = not sealed_by_other_keys(link.remote.hold_keys, request.remote_capabilities)
        try:
            if not verified and link.ready:
                if not plan_there:
                    check_ids(link.remote, request)  # bad ids first, as for any read planned here
                daemon.probe_soon(slot, link)
                raise PermissionDeniedError("remote_capabilities", "sealed by a registration of the remote engine "
                                            "that this daemon's handshake does not know (a restarted holder is "
                                            "picked up within a second)")
            admitted = admit(link.remote, request, plan=not plan_there) if verified else None
        except PermissionDeniedError as err:  # a forged or guessed capability: counted per engine in the audit log
            audit.capability_refused(slot.engine_id, remote_engine_id, request.remote_request_id, str(err))
            raise
        read = slot.reads[request.request_id] = Read(slot, remote_engine_id, request, link.remote, received_s,
                                                     deadline_at_s, admitted, traceparent=traceparent)
        if plan_there:
            daemon.dataplane.submit(read)
        elif link.ready and admitted is not None and admitted.planned.num_bytes <= self._inline_left:
            self._inline_left -= admitted.planned.num_bytes
            if daemon.dataplane.post_now(read):  # small: posted here, most often ended here too
                self.done([read])
                # After the loop's next step, which writes the completion (the engine does not wait for them).
                asyncio.get_running_loop().call_soon(daemon.dataplane.send_notices, read)
        elif link.ready:
            daemon.dataplane.submit(read)
        else:  # re-handshake first (the remote restarted or failed); the engine is not kept waiting
            daemon.spawn(self._submit_after_handshake(read, link))

    def take_batch(self, slot: EngineSlot, batch: pb.ReadBatch, received_s: float) -> None:
        """One ``ReadBatch`` of an engine's session (the gRPC ``Reads`` stream or the reads socket): its
        ack, then each read submitted or refused as a completion. Raises a typed error that ends the
        session: the registration ended, a batch of another engine, over ``max_reads_per_batch``, an ack
        of completions not sent, or an engine that reads not even its refusals."""
        config = self.daemon.config
        if slot.closing:  # reads refused now could never reach the engine: end the session instead
            raise UnavailableError("engine_id", f"the registration of {slot.engine_id!r} ended")
        if batch.engine_id and batch.engine_id != slot.engine_id:
            raise InvalidArgumentError("engine_id", f"this session belongs to {slot.engine_id!r}")
        if len(batch.reads) > config.max_reads_per_batch:
            raise InvalidArgumentError("reads", f"{len(batch.reads)} reads in one batch, the limit is "
                                                f"{config.max_reads_per_batch} (max_reads_per_batch)")
        if slot.completions.worker_generation:  # a reader worker had the session: served here from now on
            reader = slot.reader_worker
            if reader is not None:  # its reads there end (none may land once the engine moved on), unanswered
                reader.supervisor.send_to(slot.completions.worker_generation, {"op": "session_drop"})
            slot.completions.reclaim(batch.ack_seq)  # numbered on after the engine's ack
        if batch.ack_seq > slot.completions.last_seq:
            raise InvalidArgumentError("ack_seq", f"{batch.ack_seq} acks completions not sent yet "
                                                  f"(last seq {slot.completions.last_seq})")
        slot.completions.ack(batch.ack_seq)
        self.begin_batch()
        traced = self.daemon.spans.on
        for spec in batch.reads:
            if spec.resend and (spec.request_id in slot.reads or slot.completions.has(spec.request_id)):
                continue  # the first send arrived; its completion is on its way
            try:
                if spec.push:
                    self.expects.submit(slot, spec, received_s)
                else:
                    self.submit(slot, spec.remote_engine_id, read_request_from_spec(spec), spec.deadline_s, received_s,
                                check_traceparent(spec.traceparent) if traced else "")
            except KvxferError as err:
                if len(slot.reads) + len(slot.completions) >= 2 * config.max_reads_per_engine:
                    # Even refusals are not read: end the session instead of queueing more.
                    raise ResourceExhaustedError("max_reads_per_engine", "the engine does not read its "
                                                 "completions (reconnect and ack them)") from None
                self.refuse(slot, spec.request_id, err)

    def refuse(self, slot: EngineSlot, request_id: str, err: KvxferError) -> None:
        """A refused read of a Reads batch: a completion naming why (nothing was posted or written)."""
        self.daemon.metrics.read_failures.labels(ReadFailure.REFUSED.value).inc()
        slot.completions.put(refused_completion(request_id, err, time.time()))

    async def _submit_after_handshake(self, read: Read, link) -> None:
        """Re-handshake a stale link, then post; a failed handshake fails the read.

        The read's deadline bounds the wait: a handshake with a dead peer can
        take longer (the peer call's retry waits for it to come back), and the
        engine was promised an answer by the deadline. The handshake attempt
        itself is shared and shielded (:meth:`Peers.handshake`): it goes on
        for the next read.
        """
        try:
            await asyncio.wait_for(self.daemon.peers.handshake(read.slot, link.remote_engine_id),
                                   max(0.0, read.deadline_s - time.perf_counter()))
            read.remote = link.remote  # admitted there when it is posted
        except asyncio.TimeoutError:
            self._fail(read, "deadline: the re-handshake did not finish in time", ReadFailure.DEADLINE)
            return
        except KvxferError as err:
            self._fail(read, f"handshake: {err}", ReadFailure.HANDSHAKE)
            return
        self.daemon.dataplane.submit(read)

    def _fail(self, read: Read, error: str, failure: ReadFailure) -> None:
        """A read that ends before anything was posted: every block invalid."""
        read.end_unposted(error, failure)
        self.done([read])

    def done(self, finished: list[Read]) -> None:
        """The books of a round of ended reads, and the completions nobody wrote yet (event-loop thread)."""
        m = self.daemon.metrics
        for read in finished:
            slot = read.slot
            if slot.reads.get(read.request_id) is read:
                del slot.reads[read.request_id]  # (not a later read the engine sent under its id)
            # (a failed push says nothing of the link: a writer refused or failed its WRITE; a push that could
            # not reach its writers marked the link itself)
            if not read.result.ok and read.failure in STALE_LINK_FAILURES and not read.push:
                link = slot.links.get(read.remote_engine_id)
                if link is not None:
                    link.stale = True  # the next read re-handshakes (and picks up a restarted peer)
            # Written by the data-plane thread already, or now when the engine's reads socket can take it
            # (no wait for the sender task's turn); else queued for the engine's stream.
            read.complete(queue=True)
        for read in finished:  # after the writes: the engine does not wait for the metrics
            result = read.result
            if read.refusal is not None:  # refused with nothing posted (planned on the data-plane thread)
                m.read_failures.labels(ReadFailure.REFUSED.value).inc()
                continue
            if read.push:  # an expectation (issue #57): its own figures, not a read's
                m.push_duration.labels("ok" if result.ok else "failed").observe(result.duration_s)
                continue
            self._durations[result.ok].observe(result.duration_s)
            if read.post_s:
                m.read_post.observe(read.post_s)
            m.read_descriptors.observe(result.num_descriptors)
            m.read_bytes.inc(result.num_bytes)
            if read.request.remote_digests and (result.ok or read.failure is ReadFailure.CORRUPT):
                # (checked once every byte was in; a corrupt read's result counts no bytes as delivered)
                m.digest_checked_bytes.inc(read.planned.num_bytes if read.planned is not None else result.num_bytes)
            if read.inflight is not None and read.inflight.num_host_copies:
                m.same_host_copies.inc(read.inflight.num_host_copies)
            if not result.ok:
                m.read_failures.labels((read.failure or ReadFailure.TRANSFER).value).inc()
                if read.failure is ReadFailure.STALE:
                    m.stale_reads.inc()
        if self.daemon.spans.on:
            self.daemon.spans.reads(finished)
