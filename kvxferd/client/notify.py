"""Subscribe to an engine's hold events on its daemon's notify bus, with no gaps.

ZMQ PUB/SUB drops what is published before a subscription takes effect
(and under back-pressure). The subscriber therefore delivers strictly in
sequence: a jump in ``seq``, or silence while waiting, makes it fetch the
missing events with ``MissedEvents``.

After a daemon restart two more things go wrong for a naive subscriber:

* ZMQ reconnects the SUB socket by itself, but re-sends the subscription
  only when the application next touches the socket (poll or receive);
  what the new daemon publishes before that is dropped.
* Sequence numbers are per engine *on one daemon*: the new daemon counts
  from 1 again, so "seq <= last seen" no longer means "seen".

So when the client re-registers (its incarnation changes) the subscriber
restarts its sequence at the registration's ``notify_last_seq``, touches
the socket at once (re-subscribing) and fetches what it missed meanwhile.
"""

from __future__ import annotations

import collections
import time

import zmq

from kvxferd.client.engine import EngineClient
from kvxferd.plan.leases import RELEASED
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.names import topic

TERMINAL = (pb.NotifyEvent.CONSUMED, pb.NotifyEvent.EXPIRED)
__all__ = ["RELEASED", "TERMINAL", "NotifySubscriber"]  # RELEASED: an EXPIRED's reason after the engine's Release


class NotifySubscriber:
    """Events of ``client``'s engine, in order, each exactly once."""

    def __init__(self, client: EngineClient, *, catch_up_s: float = 0.2,
                 curve_keys: tuple[str, str] | None = None) -> None:
        """``curve_keys``: this subscriber's Z85 ``(public, secret)`` key pair, for a bus that uses CURVE
        (the daemon's server key comes with the registration)."""
        self.client = client
        self.catch_up_s = catch_up_s
        self.curve_keys = curve_keys
        self._socket = None
        self._connect()
        self.last_seq = client.notify_last_seq
        self._incarnation = client.incarnation
        self._last_catch_up_s = 0.0
        self.num_fetched = 0  # events that came over gRPC instead of the bus
        self._ready: collections.deque[pb.NotifyEvent] = collections.deque()
        self._held: dict[str, list[pb.NotifyEvent]] = {}

    def _connect(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        server_key = getattr(self.client, "notify_curve_server_key", "")
        if server_key:
            if self.curve_keys is None:
                raise ValueError("the notify bus uses CURVE: pass curve_keys=(public, secret) of an allowed client key")
            self._socket.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())
            self._socket.setsockopt(zmq.CURVE_PUBLICKEY, self.curve_keys[0].encode())
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, self.curve_keys[1].encode())
        self._socket.setsockopt(zmq.SUBSCRIBE, topic(self.client.engine_id))
        self._socket.connect(self.client.notify_address)
        self._address = self.client.notify_address

    def _follow_registration(self) -> None:
        """The client re-registered (maybe on a restarted daemon): restart the sequence there."""
        if self.client.incarnation == self._incarnation:
            return
        self._incarnation = self.client.incarnation
        self.last_seq = self.client.notify_last_seq
        if self.client.notify_address != self._address:
            self._connect()
        # Touching the socket lets ZMQ re-send the subscription now. What is
        # buffered may be the old daemon's tail, numbered in its sequence:
        # drop it all; the new daemon's events come back by MissedEvents.
        while self._socket.poll(0):
            self._socket.recv_multipart()
        self._catch_up()

    def _receive(self) -> None:
        """Take one message off the socket (one is ready) and accept its event."""
        _topic, data = self._socket.recv_multipart()
        event = pb.NotifyEvent()
        event.ParseFromString(data)
        self._accept(event)

    def _catch_up(self) -> None:
        reply = self.client.missed_events(self.last_seq)
        for event in reply.events:
            self._accept(event, fetched=True)

    def _accept(self, event: pb.NotifyEvent, *, fetched: bool = False) -> None:
        if event.seq <= self.last_seq:
            return  # already delivered (came both ways)
        if event.seq > self.last_seq + 1:
            self._catch_up()  # fills the gap, then this event (or a newer one) arrives again
            if event.seq <= self.last_seq:
                return
        self.last_seq = event.seq
        self.num_fetched += fetched
        self._ready.append(event)

    def next(self, timeout_s: float = 10.0) -> pb.NotifyEvent | None:
        """The next event in sequence, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._follow_registration()
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._socket.poll(int(min(left, self.catch_up_s) * 1000)):
                self._receive()
            else:
                self._catch_up()  # quiet bus: maybe the subscription missed the tail
        return self._ready.popleft()

    def poll(self) -> list[pb.NotifyEvent]:
        """Every event in sequence that can be had now (never blocks); fetches gaps as needed."""
        self._follow_registration()
        received = False
        while self._socket.poll(0):
            self._receive()
            received = True
        now = time.monotonic()
        if not received and now - self._last_catch_up_s >= self.catch_up_s:
            self._last_catch_up_s = now
            self._catch_up()  # a quiet bus may hide a lost tail
        taken = list(self._ready)
        self._ready.clear()
        return taken

    def wait_for(self, request_id: str, kinds=TERMINAL, timeout_s: float = 10.0) -> pb.NotifyEvent | None:
        """The first event of ``request_id`` whose kind is in ``kinds``; other events are kept."""
        for n, event in enumerate(self._held.get(request_id, ())):
            if event.kind in kinds:
                return self._held[request_id].pop(n)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            event = self.next(left)
            if event is None:
                break
            if event.request_id == request_id and event.kind in kinds:
                return event
            self._held.setdefault(event.request_id, []).append(event)
        return None

    def events_of(self, request_id: str) -> list[pb.NotifyEvent]:
        """Events of ``request_id`` seen so far and not taken by :meth:`wait_for`."""
        return list(self._held.get(request_id, ()))

    def close(self) -> None:
        self._socket.close(linger=0)
