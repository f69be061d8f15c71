"""Early holds: sent with the step that computes their prompt, kept alive until ``request_finished``.

An early hold's lease starts when it goes out (issue #41), but nothing can
hand it over before its step ends. A step slower than the lease (a loaded
CPU, a long batch) let the daemon end such a hold ``EXPIRED`` by its lease: a
hold no reader was ever given, reported on the bus and to the
``KvxferdHoldsExpiring`` alert exactly like a reader that never came (the
TP 2 vLLM test's first requests, issue #54). So a thread of the scheduler
process renews every early hold that has used a quarter of its lease, on
every rank, for as long as it waits to be collected::

    sent (lease from now)
      │  every lease/8: older than lease/4? ──► RenewLease on every rank
      │                                         (lease from the renewal; a rank that no longer
      │                                          knows it: stale, request_finished holds anew)
      ▼
    taken by request_finished (:meth:`EarlyHolds.pop`), or let go (aborted, other blocks)

The thread sleeps unless a hold is waiting, and a hold is renewed only in a
step slower than a quarter lease: no call is added to a request's path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvxferd.client.session import Held

log = logging.getLogger("kvxferd.vllm")

RENEW_AFTER = 0.25  # of the lease: an early hold older than this is renewed
TICK = 0.125  # of the lease: how often the thread looks


@dataclass(frozen=True)
class SentHold:
    """A hold sent on every rank: its blocks, when its current lease began (monotonic, for its age;
    ``-inf`` once a rank said it no longer holds it; and the wall clock read at the same moment, for the
    expiry readers are told), and each rank's answer to come."""

    blocks: tuple[tuple[int, ...], ...]
    sent_s: float
    answers: tuple[Callable[[], Held], ...]
    sent_unix_s: float = 0.0


class EarlyHolds:
    """Request id -> :class:`SentHold`, renewed in the background until popped (thread-safe).

    ``renew(request_ids)`` renews those holds on every rank and returns the ids
    some rank did not know; it must not raise for a rank it could not reach
    (that rank's hold is then left to its lease).
    """

    def __init__(self, lease_s: float, renew: Callable[[list[str]], Iterable[str]]) -> None:
        self.lease_s = lease_s
        self._renew = renew
        self._holds: dict[str, SentHold] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_renewals = 0  # holds renewed (once per hold and renewal), for tests and logs

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._holds

    def put(self, request_id: str, sent: SentHold) -> None:
        with self._lock:
            self._holds[request_id] = sent
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, daemon=True, name="kvxferd-early-holds")
                self._thread.start()
            self._wake.notify()

    def pop(self, request_id: str) -> SentHold | None:
        """Take a hold out (collected or let go): it is renewed no more."""
        with self._lock:
            return self._holds.pop(request_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        tick_s = self.lease_s * TICK
        while True:
            with self._lock:
                while not self._holds and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                self._wake.wait(tick_s)
                if self._closed:
                    return
                now = time.monotonic()
                due = {rid: sent for rid, sent in self._holds.items()
                       if now - sent.sent_s >= self.lease_s * RENEW_AFTER and sent.sent_s > -math.inf}
            if due:
                self._renew_due(due)

    def _renew_due(self, due: dict[str, SentHold]) -> None:
        started_s, started_unix_s = time.monotonic(), time.time()  # the daemons' new leases run from after this
        try:
            unknown = set(self._renew(list(due)))
        except Exception as err:  # noqa: BLE001 - the thread must live on; the holds fall back on their leases
            log.warning("kvxferd: could not renew early holds", extra={"error": repr(err)})
            return
        with self._lock:
            for request_id, sent in due.items():
                if self._holds.get(request_id) is sent:  # not taken or replaced meanwhile
                    lease_from_s = -math.inf if request_id in unknown else started_s
                    self._holds[request_id] = dataclasses.replace(sent, sent_s=lease_from_s,
                                                                  sent_unix_s=started_unix_s)
            self.num_renewals += len(due) - len(unknown)
