"""Which slot each socket set of the data-plane thread belongs to, and when each is worth waking for.

The data-plane thread (:mod:`kvxferd.service.dataplane.thread`) sleeps on the
socket sets of the agents it drives (:mod:`kvxferd.xfer.osutil.ucxwake`): a
slot's agent (peers READ its memory, replies to its READs arrive) and its
notice agent. This keeps the fd -> slot map, rebuilt when slots come and go,
and the mute state of :class:`WakeSets`; one thread uses it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvxferd.service.engines.slots import EngineSlot
from kvxferd.xfer.osutil.ucxwake import WakeSets

SOCKET_PACED_S = 5e-3  # a reading slot's set that woke us this lately says its replies come over sockets


class SlotSets:
    """The socket sets of every slot's agents, owned by the data-plane thread."""

    def __init__(self) -> None:
        self.wake_sets = WakeSets()  # mutes a set that fires with nothing to do
        self._owners: dict[int, tuple[EngineSlot, bool]] = {}  # wake fd -> (slot, is its notice agent's)
        self._by_slot: list[tuple[EngineSlot, tuple[int, ...], tuple[int, ...]]] = []  # (slot, agent's, notices')
        self._woke_s: dict[int, float] = {}  # id(slot) -> perf_counter when its agent's set last woke us

    def rebuild(self, slots: Iterable[EngineSlot]) -> None:
        """Map the sets of ``slots`` (call before an agent closes with its slot: its fds may be reused)."""
        for fd in self._owners:
            self.wake_sets.forget(fd)
        self._owners, self._by_slot, self._woke_s = {}, [], {}
        for slot in slots:
            if slot.served is not None:
                continue  # its agent lives in a data-plane worker, which drives it
            sets = [tuple(getattr(getattr(slot.executor, name, None), "wake_fds", ())) for name in ("agent", "notices")]
            self._by_slot.append((slot, *sets))
            for notices, fds in enumerate(sets):
                for fd in fds:
                    self._owners[fd] = (slot, bool(notices))

    def __len__(self) -> int:
        """Sets mapped (any thread: one atomic read of a dict)."""
        return len(self._owners)

    def owner(self, fd: int) -> tuple[EngineSlot, bool] | None:
        """(slot, whether it is the slot's notice agent's set), or None for an fd not mapped."""
        return self._owners.get(fd)

    def to_wait_on(self, reading: set[int], notices_active: bool) -> list[int]:
        """The live sets worth waking for now: a slot's agent's while it reads (``reading``: ids of slots
        with reads in flight), expects pushes (their WRITEs need its progress over TCP too) or a reader
        may need its progress; its notice agent's while notices go out (``notices_active``). Otherwise
        the thread's timer serves them: over shared memory readers copy alone, and a wake-up for each of
        their notices cost the holder more than the notice polls it saves (docs/benchmarks.md)."""
        fds: list[int] = []
        for slot, agent_fds, notice_fds in self._by_slot:
            if id(slot) in reading or slot.expected or slot.holder.wants_progress():
                fds.extend(agent_fds)
            if notices_active:
                fds.extend(notice_fds)
        return self.wake_sets.live(fds) if fds else fds

    def wakes_for(self, slot: EngineSlot) -> bool:
        """The slot's agent wakes the thread when a peer's bytes reach it (a set of it, none muted)."""
        fds = getattr(slot.agent, "wake_fds", ())  # the agent's own word: () once it closed
        return bool(fds) and not any(self.wake_sets.is_muted(fd) for fd in fds)

    def replies_woke(self, slot: EngineSlot) -> None:
        """The slot's agent's set woke the thread while its reads ran: their replies come over sockets."""
        self._woke_s[id(slot)] = time.perf_counter()

    def socket_paced(self, slots: Iterable[EngineSlot]) -> bool:
        """Each of ``slots`` (of the reads in flight) had its set wake the thread within SOCKET_PACED_S: a
        longer sleep costs no latency (a READ over RDMA or shared memory wakes no set, and its slot keeps
        the short sleeps)."""
        now = time.perf_counter()
        return all(now - self._woke_s.get(id(slot), -1.0) < SOCKET_PACED_S for slot in slots)
