"""The notify bus: a ZMQ PUB socket telling prefill engines what became of their holds.

Each message is two frames, ``[topic, NotifyEvent]``; the topic is the
engine id plus a NUL byte, so a subscriber of ``eng-1`` does not also get
``eng-10`` (ZMQ filters by prefix). Sequence numbers are per engine on
this daemon, start at 1 and have no gaps: a subscriber that sees a jump, or
joins late, asks ``MissedEvents`` for what it lacks. The last
``history`` events per engine are kept for that.

Who sees what: the socket is an XPUB that applies subscriptions itself
(``XPUB_MANUAL``), and only for one whole engine topic (``<id>\0``): an
empty or partial prefix, which would receive every engine's events, is
ignored. With ``notify_curve_secret_key`` the bus is CURVE-encrypted and
only the configured client keys may connect (a ZAP handler thread).

Only the event loop's thread touches the socket.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

import zmq
import zmq.auth.thread

from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import ids_to_pb
from kvxferd.wire.names import is_engine_topic, topic


log = logging.getLogger("kvxferd.bus")


class _AllowedKeys:
    """ZAP credentials provider: the configured CURVE client keys."""

    def __init__(self, keys) -> None:
        self.keys = frozenset(k.encode() if isinstance(k, str) else k for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class NotifyBus:
    """A bound PUB socket plus the per-engine history."""

    def __init__(self, host: str, port: int, *, history: int, curve_secret_key: str | None = None,
                 client_keys=(), loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._context = zmq.Context.instance()
        self._auth = None
        self.curve_public_key = ""
        self.num_refused_subscriptions = 0
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 1_000_000)  # a slow subscriber catches up via MissedEvents
        self._socket.setsockopt(zmq.XPUB_MANUAL, 1)
        if curve_secret_key:
            secret = curve_secret_key.encode()
            self.curve_public_key = zmq.curve_public(secret).decode()
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowedKeys(client_keys))
            self._socket.setsockopt(zmq.CURVE_SERVER, 1)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            self._socket.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self._history_size = history
        self._history: dict[str, collections.deque] = {}
        self._last_seq: dict[str, int] = {}
        self._loop = loop
        if loop is not None:  # subscriptions arrive as messages on the XPUB socket
            loop.add_reader(self._socket.getsockopt(zmq.FD), self.apply_subscriptions)

    def apply_subscriptions(self) -> None:
        """Apply whole-engine subscriptions that arrived; ignore any other prefix (event-loop thread)."""
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                message = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not message or message[0] not in (0, 1):
                continue
            prefix = message[1:]
            if not is_engine_topic(prefix):
                self.num_refused_subscriptions += 1
                continue
            # Applies to the subscriber whose message was received last (XPUB_MANUAL).
            self._socket.setsockopt(zmq.SUBSCRIBE if message[0] == 1 else zmq.UNSUBSCRIBE, prefix)

    def publish(self, engine_id: str, kind: str, request_id: str, block_ids=(), reason: str = "") -> pb.NotifyEvent:
        """Number, remember and send one event."""
        seq = self._last_seq.get(engine_id, 0) + 1
        self._last_seq[engine_id] = seq
        event = pb.NotifyEvent(seq=seq, engine_id=engine_id, request_id=request_id,
                               kind=pb.NotifyEvent.Kind.Value(kind), block_ids=ids_to_pb(block_ids), reason=reason)
        history = self._history.setdefault(engine_id, collections.deque(maxlen=self._history_size))
        history.append(event)
        self.apply_subscriptions()  # pending ones first: a subscriber that just joined gets this event
        try:
            self._socket.send_multipart([topic(engine_id), event.SerializeToString()], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # over the high-water mark: kept in the history
        self.apply_subscriptions()  # the socket's fd is edge-triggered: a send may have swallowed the wake-up
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
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._socket.getsockopt(zmq.FD))
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
