"""Holds, renewals and releases sent on a reads-socket session: checked, carried out, answered.

The same for a session the control plane serves (``readsock.py``) and one
handed to the engine's reader worker, which sends them here
(``service/net/sessions.py``): the hold ledger is the control plane's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvxferd.errors import InvalidArgumentError, KvxferError, ResourceExhaustedError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base.status import status_code
from kvxferd.service.engines.holding import HoldingParts, final_layers, place_hold, release_hold, renew_holds
from kvxferd.service.engines.slots import EngineSlot

if TYPE_CHECKING:
    from kvxferd.service.base.metrics import Metrics


class CallParts(HoldingParts, Protocol):
    """What the calls use of the daemon: placing holds, and the metrics of those refused."""

    metrics: Metrics


def check_calls(daemon: CallParts, slot: EngineSlot, batch: pb.ReadBatch, writable: bool) -> None:
    """A batch's holds, renewals and releases, before any is done: within ``max_reads_per_batch``, all
    of the session's engine, and a session that reads its answers (``writable``: a buffer full of unread
    answers ends it: nothing unbounded is kept for a client that does not read)."""
    calls = [*batch.holds, *batch.renewals, *batch.releases, *batch.final_layers]
    limit = daemon.config.max_reads_per_batch
    if len(calls) > limit:
        raise InvalidArgumentError("holds", f"{len(calls)} holds, renewals and releases in one batch, the "
                                            f"limit is {limit} (max_reads_per_batch)")
    for call in calls:
        if call.engine_id and call.engine_id != slot.engine_id:
            raise InvalidArgumentError("engine_id", f"this session belongs to {slot.engine_id!r}")
    if (batch.holds or batch.renewals) and not writable:
        raise ResourceExhaustedError("holds", "the session does not read the answers to its holds")


def answer_calls(daemon: CallParts, slot: EngineSlot, batch: pb.ReadBatch) -> list[bytes]:
    """Carry out a checked batch's calls (as the Hold, RenewLease and Release calls would); the
    ``CompletionBatch`` payloads to send back, in order: one for its holds, one for its renewals
    (releases are not answered: a refused one is counted)."""
    frames = []
    if batch.holds:
        answers = []
        for request in batch.holds:
            try:
                capability, digests = place_hold(daemon, slot, request)
                answers.append(pb.HoldAnswer(request_id=request.request_id, incarnation=slot.incarnation,
                                             capability=capability, digests=digests))
            except KvxferError as err:  # one hold refused: answered, the session goes on
                code = status_code(err)
                daemon.metrics.rpc_errors.labels("Hold", code.name).inc()
                answers.append(pb.HoldAnswer(request_id=request.request_id, code=code.value[0], error=str(err)))
        frames.append(pb.CompletionBatch(holds=answers).SerializeToString())
    if batch.renewals:
        answers = []
        for request in batch.renewals:
            try:
                answers.append(pb.LeaseAnswer(unknown_request_ids=renew_holds(daemon, slot, request)))
            except KvxferError as err:
                code = status_code(err)
                daemon.metrics.rpc_errors.labels("RenewLease", code.name).inc()
                answers.append(pb.LeaseAnswer(code=code.value[0], error=str(err)))
        frames.append(pb.CompletionBatch(renewals=answers).SerializeToString())
    for request in batch.final_layers:
        try:
            final_layers(daemon, slot, request)
        except KvxferError as err:  # a push whose layers are not said final fails by its deadline
            daemon.metrics.rpc_errors.labels("FinalLayers", status_code(err).name).inc()
    for request in batch.releases:
        try:
            release_hold(daemon, slot, request.request_id)
        except KvxferError as err:
            daemon.metrics.rpc_errors.labels("Release", status_code(err).name).inc()
    return frames
