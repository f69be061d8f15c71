"""Notify bus: per-engine sequence numbers, history, and a subscriber that never skips one."""

import time

import pytest
import zmq

from kvxferd.client.notify import NotifySubscriber
from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.net.bus import NotifyBus


class BusOnlyClient:
    """What a subscriber needs of its EngineClient, answered by the bus itself (no daemon)."""

    def __init__(self, bus: NotifyBus, engine_id: str) -> None:
        self.engine_id = engine_id
        self.num_missed_calls = 0
        self.register(bus)

    def register(self, bus: NotifyBus) -> None:
        """As EngineClient.register: a new incarnation, the bus's address and last sequence number."""
        self.bus, self.notify_address = bus, bus.address
        self.incarnation, self.notify_last_seq = f"inc-{id(bus)}", bus.last_seq(self.engine_id)

    def missed_events(self, after_seq: int) -> pb.MissedEventsReply:
        self.num_missed_calls += 1
        return self.bus.missed(self.engine_id, after_seq)


@pytest.fixture
def bus():
    bus = NotifyBus("127.0.0.1", 0, history=5)
    yield bus
    bus.close()


def test_sequence_and_history_per_engine(bus):
    for n in range(7):
        bus.publish("a", "CONSUMED", f"r{n}", [[n]])
    bus.publish("a10", "EXPIRED", "x", reason="lease")
    reply = bus.missed("a", 4)
    assert [e.seq for e in reply.events] == [5, 6, 7] and reply.last_seq == 7 and not reply.truncated
    reply = bus.missed("a", 0)  # 1 and 2 fell out of the history of 5
    assert [e.seq for e in reply.events] == [3, 4, 5, 6, 7] and reply.truncated
    assert bus.missed("a10", 0).events[0].reason == "lease" and bus.missed("nobody", 0).last_seq == 0
    with pytest.raises(InvalidArgumentError):
        bus.missed("a", 8)


def test_late_subscriber_gets_everything_in_order_once(bus):
    client = BusOnlyClient(bus, "e")  # registered first, subscribed only after two events
    bus.publish("e", "CONSUMED", "early1")
    bus.publish("e", "FAILED", "early2")
    subscriber = NotifySubscriber(client, catch_up_s=0.05)
    bus.publish("e1", "CONSUMED", "other-engine")  # prefix of another engine: never delivered
    time.sleep(0.3)  # the subscription is live now
    bus.publish("e", "EXPIRED", "live")
    got = [subscriber.next(2.0) for _ in range(3)]
    assert [(e.seq, e.request_id) for e in got] == [(1, "early1"), (2, "early2"), (3, "live")]
    assert subscriber.next(0.2) is None and subscriber.num_fetched >= 2
    assert subscriber.wait_for("live", timeout_s=0.1) is None  # taken already
    subscriber.close()


def _rebind(port: int) -> NotifyBus:
    """A bus on the port a closed one used: ZMQ closes sockets in its I/O thread, so the port frees a moment later
    (the bus binds its listening socket itself: OSError)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return NotifyBus("127.0.0.1", port, history=100)
        except (zmq.ZMQError, OSError) as err:
            if err.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_subscriber_follows_a_restarted_daemon_whose_sequence_starts_again():
    """Issue 14 (client advice): after a daemon restart, seq counts from 1 again and ZMQ re-subscribes
    only once the socket is touched; the subscriber ignored every new event as 'already seen'."""
    old = NotifyBus("127.0.0.1", 0, history=100)
    client = BusOnlyClient(old, "e")
    subscriber = NotifySubscriber(client, catch_up_s=0.05)
    for n in range(5):
        old.publish("e", "CONSUMED", f"old{n}")
    assert [subscriber.next(2.0).seq for _ in range(5)] == [1, 2, 3, 4, 5]
    port = int(old.address.rsplit(":", 1)[1])
    old.close()
    new = _rebind(port)  # same address, as a restarted daemon
    try:
        client.register(new)
        new.publish("e", "EXPIRED", "new1")  # before the subscriber touched its socket again
        new.publish("e", "CONSUMED", "new2")
        got = [subscriber.next(2.0) for _ in range(2)]
        assert [(e.seq, e.request_id) for e in got if e is not None] == [(1, "new1"), (2, "new2")]
        time.sleep(0.3)
        new.publish("e", "CONSUMED", "new3")  # and live delivery works on the re-subscribed socket
        assert subscriber.wait_for("new3", timeout_s=2.0).seq == 3
    finally:
        subscriber.close()
        new.close()


def test_poll_takes_what_is_there_without_blocking(bus):
    client = BusOnlyClient(bus, "p")
    subscriber = NotifySubscriber(client, catch_up_s=0.05)
    try:
        assert subscriber.poll() == []
        time.sleep(0.3)  # subscribed
        for n in range(3):
            bus.publish("p", "CONSUMED", f"r{n}")
        deadline = time.monotonic() + 2
        got = []
        while len(got) < 3 and time.monotonic() < deadline:
            got += subscriber.poll()
            time.sleep(0.01)
        assert [e.request_id for e in got] == ["r0", "r1", "r2"]
    finally:
        subscriber.close()
