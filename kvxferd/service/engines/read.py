"""A read inside the daemon: one record from the engine's submit to its written completion.

::

    ACCEPTED ──post──► POSTED ──its transfer ended──► ENDED ──complete()──► DELIVERED
      │ checked on the loop (ids, limits,                    │ the engine's session has its
      │ capabilities); waits for its plan,                   │ completion (written, or queued
      │ a re-handshake or the thread                         │ for its stream); the loop keeps
      └── refused, past its deadline, remote gone ──► ENDED  │ the books, then drops the record
          (nothing posted: every block invalid)

Who may advance it (docs/architecture.md, "Who owns a read"): the event loop
creates it and either posts it itself (``DataPlane.post_now``, a small read)
or hands it to the data-plane thread. The side that posted it polls it, ends
it, writes an ok read's completion when the engine's session can take it
(:meth:`Read.complete`) and sends the holders' notices; a read the loop could
not end within its post is handed to the thread once, for good. The loop
gets every ended read back (one list per round) and keeps the books. The one
field both read at once is :attr:`Read.state`: the loop looks whether an
earlier read of a request id was DELIVERED (the engine may reuse the id).

One clock: every ``*_s`` instant is ``time.perf_counter()``; only
``done_unix_s`` is wall time, for the engine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.plan.engine import PlannedRead, ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.completions import CompletionFeed
from kvxferd.service.base.status import status_code
from kvxferd.wire.messages import ids_to_pb
from kvxferd.xfer.backend import ReadBackend
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.records import AdmittedRead, InFlightRead, ReadResult, RemoteEngine


class ReadOwner(Protocol):
    """The engine registration a read belongs to (service/engines/slots.py's EngineSlot): where its
    completion goes, and the backend that moves its bytes."""

    completions: CompletionFeed
    executor: ReadBackend


class ReadState(enum.Enum):
    """Where a read is (the diagram above); only ever moves forward."""

    ACCEPTED = "accepted"
    POSTED = "posted"
    ENDED = "ended"
    DELIVERED = "delivered"


@dataclass(eq=False)
class Read:
    """One read an engine submitted: its request, plan, transfer, result and timings."""

    slot: ReadOwner
    remote_engine_id: str
    request: ReadRequest
    remote: RemoteEngine | None  # the link's connection it was accepted on (replaced by a re-handshake)
    received_s: float  # when its RPC or batch arrived
    deadline_s: float
    # Sealed (its capabilities checked against a connection's hold keys) and planned there: by the loop
    # (xfer/admission.py), or, a large read, sealed there and planned on the data-plane thread. None:
    # sealed by a registration the link learns at its re-handshake: admitted when posted, and until
    # then it renews no hold.
    admitted: AdmittedRead | None = None
    state: ReadState = ReadState.ACCEPTED
    inflight: InFlightRead | None = None  # the backend's transfer, once posted
    result: ReadResult | None = None
    failure: ReadFailure = ReadFailure.NONE
    refusal: KvxferError | None = None  # refused with nothing posted: its completion names the status code
    push: bool = False  # a push's expectation (issue #57): the prefill daemons wrote, this daemon read nothing
    traceparent: str = ""  # its W3C trace context, kept only while OpenTelemetry is on (service/base/spans.py)
    queued_s: float = 0.0  # planned and handed to the post (on the loop, or to the thread)
    posted_s: float = 0.0  # every rank's first transfer posted
    ended_s: float = 0.0
    done_unix_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def planned(self) -> PlannedRead | None:
        return self.admitted.planned if self.admitted is not None else None

    @property
    def verified(self) -> bool:
        """Its capabilities were checked: only then does its wait keep the holders' leases."""
        return self.admitted is not None

    # ---- advanced by the side that posted it ---------------------------------------
    def end(self, result: ReadResult, failure: ReadFailure) -> None:
        """The transfer ended (or never began): the result as the engine will see it."""
        self.ended_s = time.perf_counter()
        self.done_unix_s = time.time()
        self.result = replace(result, duration_s=self.ended_s - self.received_s)  # includes the board checks
        self.failure = failure
        self.state = ReadState.ENDED

    def end_unposted(self, error: str, failure: ReadFailure, refusal: KvxferError | None = None) -> None:
        """Ended with nothing posted: every block it was planned to write is invalid; not planned yet (a
        re-handshake that failed, a deadline before it), every local block it names. Only a refusal
        names none: ``refused_code`` says nothing was written, and its ids may be what it was refused for."""
        everything = tuple(range(len(self.remote.agent_names))) if self.remote is not None else ()
        if self.planned is not None:
            invalid = self.planned.invalid_block_ids(everything)
        elif refusal is None:  # a failed read's invalid ids are all the engine trusts: never none
            invalid = tuple(np.unique(np.asarray(ids, dtype=np.int64)) for ids in self.request.local_block_ids)
        else:
            invalid = ()
        self.refusal = refusal
        self.end(ReadResult(self.request_id, self.remote_engine_id, False, 0, 0, 0.0, invalid, everything, error),
                 failure)

    def complete(self, *, queue: bool) -> bool:
        """Hand the engine its completion; True once it has it.

        An ok read's completion is written at once when the engine's session
        can take it in order (a reads socket that sent everything before:
        :meth:`CompletionFeed.put_direct`, any thread). Otherwise, with
        ``queue`` (the event loop only), it is queued for the engine's
        stream; without, it is left for the loop. A failed read is never
        written here: the loop marks its link stale first, so the engine's
        retry re-handshakes.
        """
        if self.state is ReadState.DELIVERED:
            return True
        # DELIVERED before the write: the engine may reuse the id as soon as it reads the completion.
        if self.result.ok and self.refusal is None and self.slot.completions.put_direct(self.completion(),
                                                                                     self._delivered):
            return True
        if not queue:
            return False
        self.slot.completions.put(self.completion())
        self._delivered()
        return True

    def _delivered(self) -> None:
        self.state = ReadState.DELIVERED

    # ---- what the engine and the metrics see ---------------------------------------
    @property
    def post_s(self) -> float:
        """Received -> every rank posted (0: nothing was posted)."""
        return self.posted_s - self.received_s if self.posted_s else 0.0

    @property
    def stages_s(self) -> tuple[float, float, float]:
        """(plan, transfer, check): received -> posting began, posted -> every data READ ended, -> checks in."""
        if not self.posted_s:
            return 0.0, 0.0, 0.0
        transferred_s = self.inflight.transferred_s if self.inflight is not None else 0.0
        if not transferred_s:
            return self.queued_s - self.received_s, 0.0, 0.0
        return self.queued_s - self.received_s, transferred_s - self.posted_s, self.ended_s - transferred_s

    def completion(self) -> pb.Completion:
        """The engine's completion of it: a refusal's names its status code."""
        result = self.result
        if self.refusal is not None:
            return refused_completion(result.request_id, self.refusal, self.done_unix_s)
        plan_s, transfer_s, check_s = self.stages_s
        return pb.Completion(
            request_id=result.request_id, ok=result.ok, num_bytes=result.num_bytes,
            num_descriptors=result.num_descriptors, duration_s=result.duration_s,
            invalid_block_ids=[] if result.ok else ids_to_pb(result.invalid_block_ids), error=result.error or "",
            post_s=self.post_s, done_unix_s=self.done_unix_s, failed_ranks=result.failed_ranks,
            plan_s=plan_s, transfer_s=transfer_s, check_s=check_s,
            failure="" if result.ok else (self.failure or ReadFailure.TRANSFER).value)


def refused_completion(request_id: str, err: KvxferError, done_unix_s: float) -> pb.Completion:
    """The completion of a read refused with nothing posted or written: why, and the status code a unary
    call would have raised (``refused_code``)."""
    return pb.Completion(request_id=request_id, ok=False, error=str(err), refused_code=status_code(err).value[0],
                         done_unix_s=done_unix_s, failure=ReadFailure.REFUSED.value)
