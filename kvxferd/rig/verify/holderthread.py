"""A thread that drives NIXL agents outside a daemon: the in-process test cluster and benchmarks.

The daemon's data-plane thread polls its agents itself (service/dataplane/thread.py); this is the
test rig's stand-in, polling every agent on a fixed interval and handing notices to holders.
"""

from __future__ import annotations

import threading
import time

from kvxferd.plan.leases import FAILED, HoldEnd
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError
from kvxferd.xfer.holder import Holder
from kvxferd.xfer.osutil.osthreads import name_this_thread
from kvxferd.xfer.osutil.ucxwake import WakeSets
from kvxferd.xfer.osutil.waker import Waker


class HolderThread:
    """Drives agents outside a daemon (the in-process test cluster, benchmarks): polls each one
    every ``interval_s``; notices to an agent with a :class:`Holder` are counted by it, and the
    holds it ends wait in ``ended`` until :meth:`wait_end` takes them. Agents without a holder
    are polled only so that their transfers and notices make progress."""

    def __init__(self, agents: list[NixlAgent], holders: dict[int, Holder] | None = None, *,
                 interval_s: float = 200e-6) -> None:
        self.agents, self.holders = list(agents), dict(holders or {})
        self.ended: dict[int, list[tuple[str, HoldEnd]]] = {i: [] for i in self.holders}
        self.interval_s = interval_s
        self.num_poll_errors, self.last_poll_error = 0, ""
        self.num_woken = 0  # rounds an agent's sockets woke
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._wake = Waker()
        self._thread = threading.Thread(target=self._run, name="kvxferd-holder", daemon=True)

    def __enter__(self) -> "HolderThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop and join the thread (before the agents are destroyed)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll_once(self) -> None:
        for i, agent in enumerate(self.agents):
            try:
                messages = agent.new_messages()
            except NixlError as err:
                self.num_poll_errors, self.last_poll_error = self.num_poll_errors + 1, str(err)
                continue
            holder = self.holders.get(i)
            if holder is None:
                continue
            for sender, message in messages:
                events = [e for e in holder.on_notice(sender, message) if not e.late_notice]
                if events:
                    with self._cond:
                        self.ended[i] += events
                        self._cond.notify_all()

    def wait_end(self, i: int, request_id: str, timeout_s: float = 10.0) -> HoldEnd | None:
        """Block until agent ``i``'s hold of ``request_id`` ended (CONSUMED or EXPIRED) and take it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for n, end in enumerate(self.ended[i]):
                    if end.request_id == request_id and end.kind is not FAILED:
                        return self.ended[i].pop(n)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _run(self) -> None:
        """Polls every ``interval_s``, and at once when an agent's sockets wake it (as the daemon's data
        plane, kvxferd.xfer.osutil.ucxwake)."""
        name_this_thread()
        sets, woken = WakeSets(), []
        while not self._stop.is_set():
            self.poll_once()
            sets.after_round(woken)
            woken = self._wake.wait_any(self.interval_s, sets.live(fd for agent in self.agents for fd in agent.wake_fds))
            self.num_woken += bool(woken)
