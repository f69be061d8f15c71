"""Drive read targets: poll their agents, turn notices into releases.

A NIXL agent whose memory is read must keep making progress, or reads
stall. A prefill-side pump thread polls its agents every ``interval_s``
(sleeping in between, not spinning), decodes every notice and feeds the
rank's :class:`ReadLedger`; completed requests wait in ``releases`` until
taken with :meth:`NotificationPump.wait_released`.
Malformed notices are counted, never fatal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.holds import ReadLedger, Release
from kvxferd.plan.notifications import ReadNotice
from kvxferd.xfer.agent import NixlAgent, NixlError


class NotificationPump:
    """A thread polling agents (one ledger each) until :meth:`stop`."""

    def __init__(self, agents: Sequence[NixlAgent], *, interval_s: float = 200e-6) -> None:
        self.agents = tuple(agents)
        self.ledgers = tuple(ReadLedger() for _ in self.agents)
        self.releases: list[list[Release]] = [[] for _ in self.agents]
        self.num_bad_notices = 0
        self.num_poll_errors, self.last_poll_error = 0, ""
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvxferd-notify-pump", daemon=True)

    def __enter__(self) -> "NotificationPump":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop and join the thread (before the agents are destroyed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll_once(self) -> None:
        """One round over every agent."""
        for i, agent in enumerate(self.agents):
            try:
                by_sender = agent.poll_notifications()
            except NixlError as err:
                self.num_poll_errors, self.last_poll_error = self.num_poll_errors + 1, str(err)
                continue
            for messages in by_sender.values():
                for message in messages:
                    self._record(i, message)

    def _record(self, i: int, message: bytes) -> None:
        try:
            release = self.ledgers[i].record(ReadNotice.decode(message))
        except InvalidArgumentError:
            self.num_bad_notices += 1
            return
        if release is not None:
            with self._cond:
                self.releases[i].append(release)
                self._cond.notify_all()

    def hold(self, i: int, request_id: str, block_ids=None) -> None:
        """Register a held request on agent ``i``'s ledger."""
        release = self.ledgers[i].hold(request_id, block_ids)
        if release is not None:
            with self._cond:
                self.releases[i].append(release)
                self._cond.notify_all()

    def wait_released(self, i: int, request_id: str, timeout_s: float = 10.0) -> Release | None:
        """Block until ``request_id`` is released on agent ``i`` and take it (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for n, release in enumerate(self.releases[i]):
                    if release.request_id == request_id:
                        return self.releases[i].pop(n)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)
