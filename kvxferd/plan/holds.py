"""Prefill-side accounting: free a request's blocks once every reader is done.

A prefill rank's request may be read by several decode ranks (heterogeneous
TP, replicated heads). Each reader notifies once; the request is released
when the number of distinct readers reaches the count every notice carries.
Notices may arrive before the engine registered the hold (the read raced
the bookkeeping): they wait in the ledger until it does. Leases and
expiry are the daemon's concern; this is the counting.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.notifications import ReadNotice


@dataclass(frozen=True)
class Release:
    """A request whose every expected reader reported."""

    request_id: str
    block_ids: tuple | None  # what the engine held, if it registered a hold
    num_readers: int
    failed_readers: tuple[tuple[str, int], ...]  # readers whose read failed

    @property
    def ok(self) -> bool:
        return not self.failed_readers


@dataclass
class _Entry:
    block_ids: tuple | None = None
    held: bool = False
    expected: int | None = None
    readers: dict[tuple[str, int], bool] = field(default_factory=dict)


class ReadLedger:
    """Thread-safe count of readers per held request."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def hold(self, request_id: str, block_ids: tuple | None = None) -> Release | None:
        """Register blocks held for reading; may release at once if readers already reported."""
        with self._lock:
            entry = self._entries.setdefault(request_id, _Entry())
            if entry.held:
                raise InvalidArgumentError("request_id", f"request {request_id!r} is already held")
            entry.held, entry.block_ids = True, block_ids
            return self._maybe_release(request_id, entry)

    def record(self, notice: ReadNotice) -> Release | None:
        """Count one reader's notice; returns the release when it completes the set."""
        with self._lock:
            entry = self._entries.setdefault(notice.request_id, _Entry())
            if entry.expected is not None and entry.expected != notice.expected_readers:
                raise InvalidArgumentError(
                    "notification.expected_readers",
                    f"request {notice.request_id!r}: {notice.expected_readers} readers announced, earlier {entry.expected}")
            entry.expected = notice.expected_readers
            entry.readers.setdefault((notice.reader_engine_id, notice.reader_rank), notice.ok)
            return self._maybe_release(notice.request_id, entry)

    def _maybe_release(self, request_id: str, entry: _Entry) -> Release | None:
        if not entry.held or entry.expected is None or len(entry.readers) < entry.expected:
            return None
        del self._entries[request_id]
        failed = tuple(sorted(reader for reader, ok in entry.readers.items() if not ok))
        return Release(request_id, entry.block_ids, len(entry.readers), failed)

    def pending(self) -> dict[str, int]:
        """Held or announced requests and how many readers reported so far."""
        with self._lock:
            return {rid: len(e.readers) for rid, e in self._entries.items()}
