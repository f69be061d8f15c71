"""The notify bus: a ZMQ PUB socket telling prefill engines what became of their holds.

Each message is two frames, ``[topic, NotifyEvent]``; the topic is the
engine id plus a NUL byte, so a subscriber of ``eng-1`` does not also get
``eng-10`` (ZMQ filters by prefix). Sequence numbers are per engine on
this daemon, start at 1 and have no gaps: a subscriber that sees a jump, or
joins late, asks ``MissedEvents`` for what it lacks. The last
``history`` events per engine are kept for that.

Only the event loop's thread touches the socket.
"""

from __future__ import annotations

import collections
import itertools

import zmq

from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.wire import ids_to_pb


def topic(engine_id: str) -> bytes:
    """The subscription prefix of one engine's events."""
    return engine_id.encode() + b"\0"


class NotifyBus:
    """A bound PUB socket plus the per-engine history."""

    def __init__(self, host: str, port: int, *, history: int) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 1_000_000)  # a slow subscriber catches up via MissedEvents
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            self._socket.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self._history_size = history
        self._history: dict[str, collections.deque] = {}
        self._last_seq: dict[str, int] = {}

    def publish(self, engine_id: str, kind: str, request_id: str, block_ids=(), reason: str = "") -> pb.NotifyEvent:
        """Number, remember and send one event."""
        seq = self._last_seq.get(engine_id, 0) + 1
        self._last_seq[engine_id] = seq
        event = pb.NotifyEvent(seq=seq, engine_id=engine_id, request_id=request_id,
                               kind=pb.NotifyEvent.Kind.Value(kind), block_ids=ids_to_pb(block_ids), reason=reason)
        history = self._history.setdefault(engine_id, collections.deque(maxlen=self._history_size))
        history.append(event)
        try:
            self._socket.send_multipart([topic(engine_id), event.SerializeToString()], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # over the high-water mark: kept in the history
        return event

    def last_seq(self, engine_id: str) -> int:
        return self._last_seq.get(engine_id, 0)

    def missed(self, engine_id: str, after_seq: int) -> pb.MissedEventsReply:
        """Events with ``seq > after_seq``; ``truncated`` when some were already dropped."""
        last = self._last_seq.get(engine_id, 0)
        if after_seq > last:
            raise InvalidArgumentError("after_seq", f"{after_seq} is beyond the last sequence number {last}")
        history = self._history.get(engine_id, ())
        first_kept = history[0].seq if history else last + 1
        # Sequence numbers in the history are consecutive: index, don't scan.
        events = list(itertools.islice(history, max(0, after_seq + 1 - first_kept), None))
        return pb.MissedEventsReply(events=events, last_seq=last, truncated=after_seq + 1 < first_kept)

    def close(self) -> None:
        self._socket.close(linger=0)
