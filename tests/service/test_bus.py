"""Notify bus: per-engine sequence numbers, history, and a subscriber that never skips one."""

import time

import pytest

from kvxferd.client.notify import NotifySubscriber
from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.bus import NotifyBus


class BusOnlyClient:
    """What a subscriber needs of its EngineClient, answered by the bus itself (no daemon)."""

    def __init__(self, bus: NotifyBus, engine_id: str) -> None:
        self.bus, self.engine_id, self.notify_address = bus, engine_id, bus.address
        self.num_missed_calls = 0

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
    bus.publish("e", "CONSUMED", "early1")
    bus.publish("e", "FAILED", "early2")
    client = BusOnlyClient(bus, "e")
    subscriber = NotifySubscriber(client, catch_up_s=0.05)
    bus.publish("e1", "CONSUMED", "other-engine")  # prefix of another engine: never delivered
    time.sleep(0.3)  # the subscription is live now
    bus.publish("e", "EXPIRED", "live")
    got = [subscriber.next(2.0) for _ in range(3)]
    assert [(e.seq, e.request_id) for e in got] == [(1, "early1"), (2, "early2"), (3, "live")]
    assert subscriber.next(0.2) is None and subscriber.num_fetched >= 2
    assert subscriber.wait_for("live", timeout_s=0.1) is None  # taken already
    subscriber.close()
