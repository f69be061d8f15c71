"""Held requests with leases: the prefill daemon's record of blocks it may not free.

Pure bookkeeping; the caller passes the clock (``now``, seconds) and
publishes what ends. Every hold ends exactly once::

    hold ──► (notices from readers) ──► all expected readers reported ──► CONSUMED
      │                                                                    (blocks freed)
      ├──► lease runs out (renewals push it back, never past
      │    max_hold_s after the hold began) ────────────────────────────► EXPIRED
      └──► engine releases it / goes away ───────────────────────────────► EXPIRED

With a :class:`HoldBoard`, a hold's tag is on the board from ``hold`` until
the call that ends it: every end clears the tag before it is returned, so a
reader that still finds the tag after its read knows the blocks had not been
freed. A notice for a request that is not held (never held, already ended,
or past its lease even if the expiry timer has not run yet) counts for
nothing.

Cost per hold: ``hold``, ``release`` and ``record`` are O(1) (a dict);
``renew`` is O(1) per id; ``expire`` is O(log n) per hold it ends, through a
heap of deadlines that holds one entry per hold. A renewed hold's entry is
found early and pushed back once; entries of holds that ended otherwise are
skipped when they surface. ``expire(max_ends=...)`` bounds one sweep, so a
burst of expiries never stalls the caller's event loop.
"""

from __future__ import annotations

import enum
import heapq
import hmac
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from kvxferd.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from kvxferd.plan.board import HoldBoard, hold_tag
from kvxferd.plan.capability import HOLD_KEY_BYTES, hold_capability
from kvxferd.plan.notifications import ReadNotice

class HoldEndKind(str, enum.Enum):
    """What a holder publishes about a hold; the value is the notify bus's event name and the metric label."""

    CONSUMED = "CONSUMED"  # every expected reader reported: the blocks may go
    EXPIRED = "EXPIRED"  # lease ran out, released, or the engine went away
    FAILED = "FAILED"  # one reader reported a failed read; the hold lives on

    def __str__(self) -> str:  # the value in text and f-strings, as the plain string was
        return self.value


CONSUMED, EXPIRED, FAILED = HoldEndKind.CONSUMED, HoldEndKind.EXPIRED, HoldEndKind.FAILED
RELEASED = "released"  # the reason an EXPIRED names when the engine released the hold itself
# The reason of a FAILED event that is never published: a reader's notice that came after its hold ended
# (a push's decode side waits for every writer's, late or not, before it lets the blocks go).
LATE_NOTICE = "late notice"


@dataclass(frozen=True)
class HoldEnd:
    """How a hold ended; the daemon publishes it on the notify bus."""

    request_id: str
    kind: HoldEndKind
    block_ids: tuple
    reason: str  # "" for CONSUMED; lease | released | engine gone
    failed_readers: tuple[tuple[str, int], ...] = ()
    reported: tuple[tuple[str, int], ...] = ()  # EXPIRED: the readers whose notice came before the end

    @property
    def late_notice(self) -> bool:
        """A reader's notice after its hold ended (:data:`LATE_NOTICE`): never published."""
        return self.kind is FAILED and self.reason == LATE_NOTICE


@dataclass(frozen=True)
class NoticeOutcome:
    """What one reader's notice did: whether it counted, and what to publish."""

    alive: bool
    failed: bool = False  # a live hold got a failed reader (publish FAILED)
    end: HoldEnd | None = None


class LiveHold(NamedTuple):
    """What a push's writer learns of a hold (:meth:`HoldTable.lookup`)."""

    block_ids: tuple
    capability: bytes
    push_digest: bytes  # empty: the hold was placed for reads only
    layers_final: tuple[int, ...] | None = None  # per group, the layers final so far; None: every layer


@dataclass
class _Hold:
    block_ids: tuple
    expires_s: float
    ends_by_s: float  # no renewal pushes expires_s past this: a hold cannot pin blocks forever
    token: int  # tells this hold's heap entry from a former hold of the same request id
    tag: int  # on the board while held
    capability: bytes  # sealed with the table's hold key (kvxferd.plan.capability); notices must carry it
    push_digest: bytes = b""  # push (issue #57): the digest of the push key an expectation must present
    layers_final: tuple[int, ...] | None = None  # a push written layer by layer: per group, final so far
    expected: int | None = None
    readers: dict[tuple[str, int], bool] = field(default_factory=dict)

    def expired(self, request_id: str, reason: str) -> "HoldEnd":
        """Its EXPIRED end (lease, released, engine gone), naming the readers that had reported."""
        return HoldEnd(request_id, EXPIRED, self.block_ids, reason, reported=tuple(sorted(self.readers)))


class HoldTable:
    """Holds of one engine rank, by the engine's request id (not thread-safe); ``board`` mirrors them."""

    def __init__(self, hold_key: bytes, board: HoldBoard | None = None, max_hold_s: float = float("inf")) -> None:
        if len(hold_key) != HOLD_KEY_BYTES:
            raise InvalidArgumentError("hold_key", f"{len(hold_key)} bytes, a hold key is {HOLD_KEY_BYTES}")
        self.hold_key = hold_key  # seals every hold's capability; readers learn it at the handshake
        self.board = board
        self.max_hold_s = max_hold_s  # a hold's whole life, renewals included
        self._holds: dict[str, _Hold] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (expires_s at push, token, request id)
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, request_id: str, block_ids: tuple, lease_s: float, now: float, push_digest: bytes = b"",
             layers_final: tuple[int, ...] | None = None) -> bytes:
        """Start holding; a request is held at most once at a time. Returns the hold's capability.
        ``push_digest``: the hold may be pushed to whoever presents the key (issue #57); ``layers_final``: only
        that many layers per group are final yet (:meth:`final_layers` says when more are; None: all)."""
        if lease_s <= 0:
            raise InvalidArgumentError("lease_s", f"must be positive, got {lease_s}")
        if request_id in self._holds:
            raise InvalidArgumentError("request_id", f"request {request_id!r} is already held")
        ends_by_s = now + self.max_hold_s
        capability = hold_capability(self.hold_key, request_id, block_ids)
        entry = _Hold(block_ids, min(now + lease_s, ends_by_s), ends_by_s, next(self._tokens), hold_tag(capability),
                      capability, push_digest, layers_final)
        if self.board is not None:
            self.board.add(entry.tag)  # may refuse (both buckets full): then nothing is held
        self._holds[request_id] = entry
        heapq.heappush(self._deadlines, (entry.expires_s, entry.token, request_id))
        return entry.capability

    def renew(self, request_ids, lease_s: float, now: float) -> list[str]:
        """Push leases to at least ``now + lease_s`` (at most ``max_hold_s`` after each hold began);
        returns the ids not held."""
        unknown = []
        for request_id in request_ids:
            entry = self._holds.get(request_id)
            if entry is None or entry.expires_s <= now:
                unknown.append(request_id)
            else:
                entry.expires_s = max(entry.expires_s, min(now + lease_s, entry.ends_by_s))
        return unknown

    def release(self, request_id: str) -> HoldEnd:
        """The engine freed the blocks itself (e.g. the request was aborted)."""
        entry = self._holds.pop(request_id, None)
        if entry is None:
            raise NotFoundError("request_id", f"request {request_id!r} is not held")
        self._unboard(entry)
        return entry.expired(request_id, RELEASED)

    def record(self, notice: ReadNotice, now: float, expected_readers: int | None = None) -> NoticeOutcome:
        """Count one reader; says whether the hold was alive when the notice came.

        ``expected_readers`` is the holder's own count for this reader
        engine; a notice announcing another count is refused (a reader
        must not be able to end a hold early). Without it the notice's
        count is taken, and later notices must agree with the first.
        """
        entry = self._holds.get(notice.request_id)
        if entry is None or entry.expires_s <= now:
            return NoticeOutcome(alive=False)
        if not hmac.compare_digest(notice.capability, entry.capability):
            # Only a reader given this hold's capability may count for it (another tenant's reader
            # naming this request id must not end it).
            raise PermissionDeniedError("notification.capability",
                                        f"request {notice.request_id!r}: not the capability of this hold")
        expected = entry.expected if expected_readers is None else expected_readers
        if expected is not None and expected != notice.expected_readers:
            raise InvalidArgumentError("notification.expected_readers",
                                       f"request {notice.request_id!r}: {notice.expected_readers} readers announced, "
                                       f"the holder expects {expected}")
        entry.expected = notice.expected_readers
        reader = (notice.reader_engine_id, notice.reader_rank)
        first = reader not in entry.readers
        entry.readers.setdefault(reader, notice.ok)
        failed = first and not notice.ok
        if len(entry.readers) < entry.expected:
            return NoticeOutcome(alive=True, failed=failed)
        del self._holds[notice.request_id]
        self._unboard(entry)
        failed_readers = tuple(sorted(r for r, ok in entry.readers.items() if not ok))
        return NoticeOutcome(True, failed, HoldEnd(notice.request_id, CONSUMED, entry.block_ids, "", failed_readers))

    def expire(self, now: float, max_ends: int | None = None) -> list[HoldEnd]:
        """End holds whose lease ran out by ``now`` (at most ``max_ends``; the rest on the next call)."""
        ended: list[HoldEnd] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now and (max_ends is None or len(ended) < max_ends):
            _, token, request_id = heapq.heappop(deadlines)
            entry = self._holds.get(request_id)
            if entry is None or entry.token != token:
                continue  # consumed or released already (or a former hold of this id)
            if entry.expires_s > now:  # renewed since this entry was pushed
                heapq.heappush(deadlines, (entry.expires_s, token, request_id))
                continue
            del self._holds[request_id]
            self._unboard(entry)
            ended.append(entry.expired(request_id, "lease"))
        if not self._holds:
            deadlines.clear()  # entries of holds that ended otherwise
        return ended

    def drop_all(self, reason: str) -> list[HoldEnd]:
        """End every hold (the engine is going away)."""
        ended = [entry.expired(rid, reason) for rid, entry in self._holds.items()]
        for entry in self._holds.values():
            self._unboard(entry)
        self._holds.clear()
        self._deadlines.clear()
        return ended

    def _unboard(self, entry: _Hold) -> None:
        """Clear a hold's tag: before its end leaves this table, so before anyone can free its blocks."""
        if self.board is not None:
            self.board.remove(entry.tag)

    def lookup(self, request_id: str, now: float) -> LiveHold | None:
        """A live hold of ``request_id``; None when it is not held (or its lease ran out): a push writes only
        blocks held now."""
        entry = self._holds.get(request_id)
        if entry is None or entry.expires_s <= now:
            return None
        return LiveHold(entry.block_ids, entry.capability, entry.push_digest, entry.layers_final)

    def final_layers(self, request_id: str, layers_final: tuple[int, ...] | None, now: float) -> None:
        """More of a held request's layers are final (None: every layer); never fewer than said before."""
        entry = self._holds.get(request_id)
        if entry is None or entry.expires_s <= now:
            raise NotFoundError("request_id", f"request {request_id!r} is not held")
        if entry.layers_final is None:
            if layers_final is None:
                return
            raise InvalidArgumentError("layers_final", f"request {request_id!r}: every layer is final already")
        if layers_final is not None:
            if len(layers_final) != len(entry.layers_final):
                raise InvalidArgumentError("layers_final", f"{len(layers_final)} groups, the hold has "
                                                           f"{len(entry.layers_final)}")
            if any(new < old for new, old in zip(layers_final, entry.layers_final)):
                raise InvalidArgumentError("layers_final", f"request {request_id!r}: {list(layers_final)} final "
                                                           f"after {list(entry.layers_final)}: layers never become unfinal")
        entry.layers_final = None if layers_final is None else tuple(layers_final)

    def request_ids(self) -> list[str]:
        return list(self._holds)
