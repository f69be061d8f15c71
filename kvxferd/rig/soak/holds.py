"""Every hold the soak placed, and every bus event that ended one: each hold must end exactly once.

The driver listens on each prefill daemon's notify bus itself (a whole
engine topic on loopback), independent of the engine processes it kills,
and numbers the daemons' lives: a restarted daemon starts its sequence at 1
again and knows nothing of the holds of the one before::

    (rank, life, engine id, request id) ─► Hold ─► ends: [CONSUMED | EXPIRED]   exactly one
                                                         (none, if its daemon was killed first)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.verify.hosts.nsenter import zmq_context_in
from kvxferd.wire.names import topic

TERMINAL = {pb.NotifyEvent.CONSUMED: "CONSUMED", pb.NotifyEvent.EXPIRED: "EXPIRED"}


@dataclass
class Hold:
    """One hold on one prefill rank's daemon life."""

    certain: bool  # the Hold call answered OK (else it may or may not have been placed)
    placed_s: float
    ends: list[str] = field(default_factory=list)
    lost: bool = False  # its daemon was killed: no event may come
    ended_s: float | None = None  # when the driver saw its first end


class HoldLedger:
    """Holds by ``(rank, life, engine id, request id)`` and the bus events that end them."""

    def __init__(self, notify_addresses: list[str], violate, *, netns: str | None = None) -> None:
        """``netns``: the daemons' buses are on the loopback of that network namespace (``--hosts``)."""
        self._context = zmq_context_in(netns) if netns else zmq.Context.instance()
        self._addresses = list(notify_addresses)
        self._violate = violate
        self.lives = [0] * len(notify_addresses)
        self._last_seq: dict[tuple[int, str], int] = {}
        self._engine_ids: set[str] = set()
        self._sockets = [self._socket(address) for address in self._addresses]
        self.holds: dict[tuple[int, int, str, str], Hold] = {}
        self.num_failed_events = 0

    def _socket(self, address: str):
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: a gap is the daemon's
        for engine_id in self._engine_ids:
            socket.setsockopt(zmq.SUBSCRIBE, topic(engine_id))
        socket.connect(address)
        return socket

    def follow(self, engine_id: str) -> None:
        """Record ``engine_id``'s events from now on (the subscription takes a moment to reach the daemons)."""
        self._engine_ids.add(engine_id)
        for socket in self._sockets:
            socket.setsockopt(zmq.SUBSCRIBE, topic(engine_id))

    def placed(self, rank: int, engine_id: str, request_id: str, answer: str) -> None:
        self.holds[(rank, self.lives[rank], engine_id, request_id)] = Hold(answer == "ok", time.monotonic())

    def daemon_killed(self, rank: int) -> None:
        """Rank ``rank``'s daemon died: take what it sent, then its holds can never end."""
        self.drain()
        for (q, life, _, _), hold in self.holds.items():
            if q == rank and life == self.lives[rank] and not hold.ends:
                hold.lost = True

    def daemon_restarted(self, rank: int) -> None:
        """A new life of rank ``rank``'s daemon on the same address: a new sequence."""
        self._sockets[rank].close(linger=0)
        self.lives[rank] += 1
        self._last_seq = {k: v for k, v in self._last_seq.items() if k[0] != rank}
        self._sockets[rank] = self._socket(self._addresses[rank])

    def drain(self) -> None:
        """Take every event that arrived (never blocks)."""
        for rank, socket in enumerate(self._sockets):
            while socket.poll(0):
                _topic, data = socket.recv_multipart()
                self._accept(rank, pb.NotifyEvent.FromString(data))

    def _accept(self, rank: int, event: pb.NotifyEvent) -> None:
        key = (rank, event.engine_id)
        last = self._last_seq.get(key, 0)
        if last and event.seq != last + 1:
            self._violate("bus_sequence", f"rank {rank} {event.engine_id}: seq {event.seq} after {last}")
        self._last_seq[key] = event.seq
        if event.kind == pb.NotifyEvent.FAILED:
            self.num_failed_events += 1
            return
        hold = self.holds.get((rank, self.lives[rank], event.engine_id, event.request_id))
        if hold is None:
            self._violate("hold_ends_once", f"rank {rank}: {TERMINAL.get(event.kind, event.kind)} for "
                                            f"{event.request_id!r}, which was never held there")
            return
        hold.ends.append(TERMINAL.get(event.kind, str(event.kind)))
        hold.ended_s = hold.ended_s or time.monotonic()
        if len(hold.ends) > 1:
            self._violate("hold_ends_once", f"rank {rank}: {event.request_id!r} ended {hold.ends}")

    def open_holds(self) -> list[tuple]:
        """Holds that must still end: placed for sure, on a daemon that lives, no end yet."""
        return [key for key, hold in self.holds.items() if hold.certain and not hold.lost and not hold.ends]

    def wait_ended(self, timeout_s: float) -> list[tuple]:
        """Wait until every hold that must end has ended; those that did not."""
        deadline = time.monotonic() + timeout_s
        while (still := self.open_holds()) and time.monotonic() < deadline:
            time.sleep(0.1)
            self.drain()
        return still

    def ended_after(self, rank: int, life: int, since_s: float) -> list[float]:
        """Seconds from ``since_s`` until each hold of that daemon life placed before it ended."""
        return [hold.ended_s - since_s for (q, l, _, _), hold in self.holds.items()
                if q == rank and l == life and hold.placed_s <= since_s and hold.ended_s and hold.ended_s > since_s]

    def counts(self) -> dict[str, int]:
        """Holds by how they ended: CONSUMED, EXPIRED, lost_with_daemon, unplaced (a failed call, no event), open."""
        counts = {"CONSUMED": 0, "EXPIRED": 0, "lost_with_daemon": 0, "unplaced": 0, "open": 0}
        for hold in self.holds.values():
            if hold.ends:
                counts[hold.ends[0]] += 1
            elif hold.lost:
                counts["lost_with_daemon"] += 1
            elif not hold.certain:
                counts["unplaced"] += 1
            else:
                counts["open"] += 1
        return counts

    def close(self) -> None:
        for socket in self._sockets:
            socket.close(linger=0)
