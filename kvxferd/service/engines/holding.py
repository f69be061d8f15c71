"""Holds: the checks and the bookkeeping of ``Hold``, ``RenewLease`` and ``Release``, for the gRPC calls and the
reads socket.

A hold keeps a request's blocks for its readers until they report (CONSUMED),
its lease runs out or it is released (EXPIRED); see :mod:`kvxferd.plan.leases`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvxferd.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError
from kvxferd.plan.capability import check_push_digest
from kvxferd.plan.holddigests import digest_hold
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import check_id, check_seconds, ids_from_pb
from kvxferd.wire.tracecontext import check_traceparent
from kvxferd.xfer.verify import host_memories

if TYPE_CHECKING:
    from kvxferd.service.base.config import DaemonConfig
    from kvxferd.service.base.spans import DaemonSpans
    from kvxferd.service.engines.registry import Registry, SlotThread
    from kvxferd.service.engines.slots import EngineSlot


class HoldingParts(Protocol):
    """What placing a hold uses of the daemon (the daemon, through ``net/parts.py``'s view, gives it)."""

    config: DaemonConfig
    spans: DaemonSpans
    registry: Registry
    dataplane: SlotThread

    def wake_maintenance(self) -> None:
        """A first hold arrived: leave the idle maintenance tick now."""

    def publish(self, slot: "EngineSlot", end) -> None:
        """Publish a hold's end on the notify bus."""

    def held(self, slot: "EngineSlot", request_id: str) -> None:
        """A hold was placed: pushes waiting for it may start (after this call's answer)."""


def check_block_ids(lists, slot: "EngineSlot", field: str) -> tuple[np.ndarray, ...]:
    """Block ids per cache group of ``slot``'s engine, each in range (typed error naming ``field``)."""
    groups = slot.cache.groups
    if len(lists) != len(groups):
        raise InvalidArgumentError(field, f"{len(lists)} groups given, engine has {len(groups)}")
    out = ids_from_pb(lists)
    for g, (ids, group) in enumerate(zip(out, groups)):
        if len(ids) and (ids.min() < 0 or ids.max() >= group.spec.num_blocks):
            raise InvalidArgumentError(f"{field}[{g}]", f"block ids must lie in [0, {group.spec.num_blocks})")
    return out


def lease_seconds(daemon: HoldingParts, value: float) -> float:
    """A requested lease (0: the default), checked against ``max_lease_s``."""
    return check_seconds(value, "lease_s", default_s=daemon.config.lease_s, max_s=daemon.config.max_lease_s)


PUSH_AWAIT_S = 2.0  # after a push's hold, its expectation is polled for this fast at most


def place_hold(daemon: HoldingParts, slot: "EngineSlot", request: pb.HoldRequest) -> tuple[bytes, bytes]:
    """Hold ``request``'s blocks on ``slot`` (event-loop thread): the hold's capability (readers must present
    it) and, with ``want_digests``, this rank's digests of the held blocks (else b""). Raises a typed error,
    holding nothing."""
    daemon.registry.check_accepting()
    check_id(request.request_id, "request_id")
    block_ids = check_block_ids(request.block_ids, slot, "block_ids")
    lease_s = lease_seconds(daemon, request.lease_s)
    push_digest = check_push_digest(request.push_key_digest, "push_key_digest")
    layers_final = check_layers_final(request.layers_final, slot, "layers_final")
    if layers_final is not None and not push_digest:
        raise InvalidArgumentError("layers_final", "only a push's hold (push_key_digest) is written layer by layer")
    limit = daemon.config.max_holds_per_engine
    if len(slot.holds) >= limit:
        raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} holds {limit} requests already")
    if layers_final is not None and slot.layers_ahead:
        layers_final = _with_layers_ahead(slot, request.request_id, layers_final)
    if request.want_digests and layers_final is not None:
        raise InvalidArgumentError("want_digests", "a hold written layer by layer is not final yet: no digests")
    # Digested before the hold is placed: the KV is final now, and a refusal holds nothing. On the event
    # loop, about 1 ms per 7 MB of held host memory here (docs/integrity.md).
    digests = hold_digests(slot, block_ids) if request.want_digests else b""
    with slot.lock:
        capability = slot.holds.hold(request.request_id, tuple(block_ids), lease_s, time.monotonic(), push_digest,
                                     layers_final)
    if daemon.spans.on and check_traceparent(request.traceparent):
        daemon.spans.hold_placed(slot.engine_id, request.request_id, request.traceparent,
                                 sum(len(ids) for ids in block_ids), bool(push_digest))
    if len(slot.holds) == 1:
        daemon.dataplane.wake()  # from idle polling to polling for this hold's readers
        daemon.wake_maintenance()  # and from the idle tick to the lease tick
    if push_digest:  # a push: its expectations start it; one not here yet is polled for fast
        slot.awaited.add(request.request_id)
        slot.awaited_until_s = time.monotonic() + PUSH_AWAIT_S
        daemon.dataplane.wake()
        if slot.expectations:
            daemon.held(slot, request.request_id)
    return capability, digests


def hold_digests(slot: "EngineSlot", block_ids) -> bytes:
    """This rank's digests of ``block_ids`` (per group), read from the daemon's mapping of the engine's host
    memory; a GPU cache's cannot be read here yet (FAILED_PRECONDITION)."""
    memories = host_memories(slot.cache)
    if memories is None:
        raise UnavailableError("want_digests", f"no digests of {slot.cache.mem_type} memory yet: host memory only")
    return digest_hold(slot.cache, memories, block_ids).encode()


def check_layers_final(counts, slot: "EngineSlot", field: str) -> tuple[int, ...] | None:
    """Per group, how many layers are final (each at most the group's layers); None when every layer is, or
    when none are given (the whole hold is final)."""
    if not len(counts):
        return None
    totals = slot.cache.layer_counts
    if len(counts) != len(totals):
        raise InvalidArgumentError(field, f"{len(counts)} groups given, engine has {len(totals)}")
    for g, (count, total) in enumerate(zip(counts, totals)):
        if count > total:
            raise InvalidArgumentError(f"{field}[{g}]", f"{count} layers final, the group has {total}")
    return None if tuple(counts) == totals else tuple(int(c) for c in counts)


def final_layers(daemon: HoldingParts, slot: "EngineSlot", request: pb.FinalLayersRequest) -> bool:
    """More layers of a hold placed with ``layers_final`` are final (event-loop thread): the push writes them
    (after this call's answer). Whether every layer is final now."""
    check_id(request.request_id, "request_id")
    if not len(request.layers_final):  # (on a Hold, none means every layer: here it would be a mistake)
        raise InvalidArgumentError("layers_final", "one count per cache group")
    layers_final = check_layers_final(request.layers_final, slot, "layers_final")
    now = time.monotonic()
    try:
        with slot.lock:
            slot.holds.final_layers(request.request_id, layers_final, now)
    except NotFoundError:  # its hold may still be on its way (another socket): kept a little while for it
        _keep_layers_ahead(daemon, slot, request.request_id, layers_final, now)
        return layers_final is None
    if slot.expectations:
        daemon.held(slot, request.request_id)
    return layers_final is None


LAYERS_AHEAD_S = 5.0  # a FinalLayers before its hold waits this long for it


def _keep_layers_ahead(daemon: HoldingParts, slot: "EngineSlot", request_id: str, layers_final, now: float) -> None:
    ahead = slot.layers_ahead
    for stale in [rid for rid, (_, until_s) in ahead.items() if until_s <= now]:
        del ahead[stale]
    if request_id not in ahead and len(ahead) >= daemon.config.max_holds_per_engine:
        raise ResourceExhaustedError("max_holds_per_engine", f"engine {slot.engine_id!r} has "
                                                             f"{len(ahead)} FinalLayers waiting for their holds")
    earlier = ahead.get(request_id, ((), 0.0))[0]
    ahead[request_id] = (_later_layers(earlier, layers_final), now + LAYERS_AHEAD_S)


def _with_layers_ahead(slot: "EngineSlot", request_id: str, layers_final: tuple[int, ...]):
    """``layers_final`` of a hold being placed, with what a FinalLayers that came first said."""
    ahead = slot.layers_ahead.pop(request_id, None)
    if ahead is None or ahead[1] <= time.monotonic():
        return layers_final
    merged = _later_layers(layers_final, ahead[0])
    return None if merged == slot.cache.layer_counts else merged


def _later_layers(a, b):
    """The later of two reports of final layers (None: every layer; ``()``: none said)."""
    if a is None or b is None:
        return None
    if not a or not b:
        return a or b
    return tuple(max(x, y) for x, y in zip(a, b))


def renew_holds(daemon: HoldingParts, slot: "EngineSlot", request: pb.RenewLeaseRequest) -> list[str]:
    """Extend ``slot``'s holds of ``request.request_ids`` (event-loop thread); the ids it does not hold."""
    lease_s = lease_seconds(daemon, request.lease_s)
    with slot.lock:
        return slot.holds.renew(request.request_ids, lease_s, time.monotonic())


def release_hold(daemon: HoldingParts, slot: "EngineSlot", request_id: str) -> None:
    """End ``slot``'s hold of ``request_id`` now (``EXPIRED``, reason "released"), if it has one."""
    with slot.lock:
        end = slot.holds.release(request_id)
    daemon.publish(slot, end)
    if slot.expectations:  # a push written layer by layer that waits for more layers ends now
        daemon.held(slot, request_id)
