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

Bounds: libzmq keeps every subscription a subscriber sends (about 12 KiB
for a 257-byte topic, applied or not, until that subscriber leaves), so a
subscriber sending 40,000 distinct topics grew a daemon by 1.1 GiB and
held its loop 4 s. A subscription message is at most
``MAX_SUBSCRIPTION_BYTES`` (a larger one drops its connection) and at most
``MAX_SUBSCRIPTIONS_PER_WAKE`` are read per turn of the loop. libzmq takes
in what arrives whether or not the loop reads it (``SUBSCRIPTION_HWM``
bounds its pipes, which it empties into its own queue and table: measured
for issue #53), so the bound is on what each connection sent, as the kernel
counts it: :mod:`busguard` closes a connection past 16 KiB, refuses its
source (a uid on loopback) for a while, and past ``max_subscriptions`` x
``MAX_SUBSCRIPTION_BYTES`` for all connections together refuses the
heaviest sources, looking every ``CHECK_EVERY`` messages and every 10 ms
while they come (never more than a twentieth of the time). Other subscribers keep their
connections: the bus used to start over instead, dropping every
subscriber, and one flooder sent every engine's events through
``MissedEvents`` (issue #53: CONSUMED p50 10.8 -> 203 ms). The bus still
starts over where busguard cannot tell connections apart (no libzmq
monitor, no ``tcp_info``: then after ``max_subscriptions`` subscription
messages) or where too many connections must end at once: a new ZMQ
socket takes over the same listening socket (so nobody else can bind the
port meanwhile) and the old one is closed with every subscriber, who
reconnect by themselves, subscribe again and fetch what they missed with
``MissedEvents``.

Only the event loop's thread touches the ZMQ socket.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable

import zmq
import zmq.auth.thread

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.net.busguard import SubscriberGuard
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import ids_to_pb
from kvxferd.wire.names import is_engine_topic, topic


log = logging.getLogger("kvxferd.bus")
MAX_SUBSCRIPTIONS_PER_WAKE = 256  # subscription messages taken per call: a flood never holds the loop long
# A larger message from a subscriber drops its connection (ZMQ_MAXMSGSIZE): an engine topic is at most
# 257 bytes (267 as a ZMTP 3.1 SUBSCRIBE command), and the CURVE handshake's commands fit too.
MAX_SUBSCRIPTION_BYTES = 512
# Messages each connection's pipe holds (ZMQ_RCVHWM; 1 stalls a CURVE connection). This does not bound what
# libzmq takes in: it empties the pipes into its own queue and table whenever the socket is used (a 5,000-topic
# burst was all taken in with nothing read), which is why busguard counts bytes in the kernel.
SUBSCRIPTION_HWM = 4
RESTART_LOG_S = 10.0  # at most one warning line per this long about the bus starting over or closing flooders
CHECK_EVERY = 64  # messages taken between two looks at what each connection sent (busguard: and time)


class _AllowedKeys:
    """ZAP credentials provider: the configured CURVE client keys."""

    def __init__(self, keys) -> None:
        self.keys = frozenset(k.encode() if isinstance(k, str) else k for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class NotifyBus:
    """A bound PUB socket plus the per-engine history."""

    def __init__(self, host: str, port: int, *, history: int, curve_secret_key: str | None = None,
                 client_keys=(), loop: asyncio.AbstractEventLoop | None = None, max_subscriptions: int = 1024,
                 on_refused: Callable[[str], None] | None = None) -> None:
        """``max_subscriptions``: what all subscribers together may send, in subscription messages of
        ``MAX_SUBSCRIPTION_BYTES`` (the heaviest source's connections are closed past it; without libzmq's
        monitor or the kernel's counts, subscription messages taken before the bus starts over);
        ``on_refused(reason)``: a subscription not applied, ``"prefix"`` (not one whole engine topic),
        ``"flood"`` (a connection closed for the budget: once per connection) or ``"limit"`` (the one past
        ``max_subscriptions`` where the bus started over)."""
        self._context = zmq.Context.instance()
        self._auth = None
        self.curve_public_key = ""
        self._curve_secret = b""
        self.max_subscriptions = max_subscriptions
        self.num_subscriptions = 0  # subscription messages taken since the ZMQ socket was opened
        self.num_refused_subscriptions = self.num_restarts = 0
        self._guard: SubscriberGuard | None = None
        self._guarded = True  # False once the kernel or libzmq could not say: starting over is the bound then
        self._num_taken = 0  # messages taken since the last look at the connections
        self._on_refused = on_refused or (lambda reason: None)
        self._loop = loop
        if curve_secret_key:
            self._curve_secret = curve_secret_key.encode()
            self.curve_public_key = zmq.curve_public(self._curve_secret).decode()
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowedKeys(client_keys))
        self._listener = _listen(host, port)
        self._warned_s = -RESTART_LOG_S
        bind_host = f"[{host}]" if ":" in host else host
        self.address = f"tcp://{bind_host}:{self._listener.getsockname()[1]}"
        try:
            self._socket, self._guard = self._open_socket()
        except BaseException:
            self._listener.close()
            raise
        self._history_size = history
        self._history: dict[str, collections.deque] = {}
        self._last_seq: dict[str, int] = {}
        self._more_scheduled = False
        if loop is not None:  # subscriptions arrive as messages on the XPUB socket
            self._watch(self._socket)

    def _open_socket(self, refusals: dict | None = None) -> tuple[zmq.Socket, SubscriberGuard | None]:
        """An XPUB socket serving the bus's listening socket (a duplicate of its fd, which ZMQ closes), and
        the guard that follows its connections from the first (``refusals``: the previous guard's)."""
        sock, guard = self._context.socket(zmq.XPUB), None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1_000_000)  # a slow subscriber catches up via MissedEvents
            sock.setsockopt(zmq.XPUB_MANUAL, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
            if self._listener.family == socket.AF_INET6:
                sock.setsockopt(zmq.IPV6, 1)
            if self._curve_secret:
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve_secret)
            if self._guarded:
                try:
                    guard = SubscriberGuard(sock, self._listener.getsockname()[1],
                                            self.max_subscriptions * MAX_SUBSCRIPTION_BYTES, refusals)
                except zmq.ZMQError as err:
                    self._unguard(err)
            sock.setsockopt(zmq.USE_FD, os.dup(self._listener.fileno()))
            sock.bind(self.address)
        except BaseException:
            if guard is not None:
                guard.close()
            sock.close(linger=0)
            raise
        return sock, guard

    def _watch(self, sock: zmq.Socket) -> None:
        """Wake the loop for subscriptions (and, followed, for accepted connections)."""
        self._loop.add_reader(sock.getsockopt(zmq.FD), self.apply_subscriptions)
        if self._guard is not None:
            self._loop.add_reader(self._guard.fileno(), self._connections_changed)

    def _unwatch(self, sock: zmq.Socket) -> None:
        self._loop.remove_reader(sock.getsockopt(zmq.FD))
        if self._guard is not None:
            self._loop.remove_reader(self._guard.fileno())

    def _unguard(self, err: Exception) -> None:
        """The connections cannot be followed here: from now on the bus starts over at the limit."""
        log.warning("notify bus: cannot tell subscriber connections apart; a flood makes the bus start over",
                    extra={"error": str(err)})
        self._guarded = False
        if getattr(self, "_guard", None) is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._guard.fileno())
            self._guard.close()
            self._guard = None

    def _connections_changed(self) -> None:
        """Accepted or closed connections (the monitor): many new ones are looked at like many messages."""
        if self._guard is None:
            return
        try:
            shut = self._guard.take_events()
        except zmq.ZMQError as err:
            self._unguard(err)
            return
        for _ in range(shut):
            self._refuse("flood")

    def _check_connections(self) -> bool:
        """Charge every connection, shut down flooders' (busguard); True when the bus started over instead."""
        self._num_taken = 0
        try:
            shut, start_over = self._guard.check()
        except (OSError, zmq.ZMQError) as err:
            self._unguard(err)
            return False
        for _ in range(shut):
            self._refuse("flood")
        if shut and time.monotonic() - self._warned_s >= RESTART_LOG_S:
            self._warned_s = time.monotonic()
            log.warning("notify bus: subscriber connections sent more than their share and were closed; their "
                        "sources are refused for a while", extra={"connections_closed": self._guard.num_shut})
        if start_over:
            self._refuse("limit")
            self._restart()
        return start_over

    def apply_subscriptions(self) -> None:
        """Apply whole-engine subscriptions that arrived; ignore any other prefix (event-loop thread).

        Takes at most ``MAX_SUBSCRIPTIONS_PER_WAKE`` messages, then leaves the
        rest to a later turn of the loop; every ``CHECK_EVERY`` messages the
        connections are charged what they sent (:meth:`_check_connections`);
        where they cannot be, the subscription past ``max_subscriptions``
        makes the bus start over (:meth:`_restart`).
        """
        self._more_scheduled = False
        if self._socket.closed:  # a turn scheduled before close()
            return
        if self._loop is None:  # nobody else drains the monitor (a bus without a loop: tests, tools)
            self._connections_changed()
        for _ in range(MAX_SUBSCRIPTIONS_PER_WAKE):
            # Asked first: a recv that finds nothing raises zmq.Again, and publish() looks twice per event
            # (about a tenth of a holder's CPU per read at 300/s, docs/benchmarks.md). Asking reads the
            # socket's pending commands too, as a recv would (what re-arms its edge-triggered fd).
            if not self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                message = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._num_taken += 1
            if self._guard is not None and self._guard.due(self._num_taken, CHECK_EVERY):
                if self._check_connections():
                    return  # started over: the new socket's messages come in a later turn
            if not message or message[0] not in (0, 1):
                continue
            subscribe, prefix = message[0] == 1, message[1:]
            if subscribe:
                self.num_subscriptions += 1
                if self._guard is None and self.num_subscriptions > self.max_subscriptions:
                    self._refuse("limit")
                    self._restart()
                    return
            if not is_engine_topic(prefix):
                if subscribe:
                    self._refuse("prefix")
                continue
            # Applies to the subscriber whose message was received last (XPUB_MANUAL).
            self._socket.setsockopt(zmq.SUBSCRIBE if subscribe else zmq.UNSUBSCRIBE, prefix)
        if self._loop is not None and not self._more_scheduled:  # more may wait: the fd will not say so again
            self._more_scheduled = True
            self._loop.call_soon(self.apply_subscriptions)

    def _refuse(self, reason: str) -> None:
        self.num_refused_subscriptions += 1
        self._on_refused(reason)

    def _restart(self) -> None:
        """Drop every subscriber and what libzmq keeps of their subscriptions; go on on the same listener
        (where the connections cannot be followed, or too many of them must end at once: busguard)."""
        if self._loop is not None:
            self._unwatch(self._socket)
        old, old_guard = self._socket, self._guard
        self._socket, self._guard = self._open_socket(old_guard.refusals if old_guard is not None else None)
        if self._loop is not None:
            self._watch(self._socket)
        if old_guard is not None:
            old_guard.close()
        old.close(linger=0)
        self.num_subscriptions = 0
        self.num_restarts += 1
        if time.monotonic() - self._warned_s >= RESTART_LOG_S:  # a flood restarts it again and again
            self._warned_s = time.monotonic()
            log.warning("notify bus: max_bus_subscriptions subscriptions arrived; every subscriber was dropped "
                        "(they subscribe again)", extra={"max_bus_subscriptions": self.max_subscriptions,
                                                        "restarts": self.num_restarts})
        if self._loop is not None and not self._more_scheduled:  # the new socket may have news already
            self._more_scheduled = True
            self._loop.call_soon(self.apply_subscriptions)

    def publish(self, engine_id: str, kind: str, request_id: str, block_ids=(), reason: str = "") -> pb.NotifyEvent:
        """Number, remember and send one event."""
        (event,) = self.publish_many([(engine_id, kind, request_id, block_ids, reason)])
        return event

    def publish_many(self, events: list[tuple[str, str, str, object, str]]) -> list[pb.NotifyEvent]:
        """:meth:`publish` for each ``(engine_id, kind, request_id, block_ids, reason)`` in order; pending
        subscriptions are applied before the first and after the last, not around each."""
        self.apply_subscriptions()  # pending ones first: a subscriber that just joined gets these events
        sent = [self._send(*event) for event in events]
        self.apply_subscriptions()  # the socket's fd is edge-triggered: a send may have swallowed the wake-up
        return sent

    def _send(self, engine_id: str, kind: str, request_id: str, block_ids, reason: str) -> pb.NotifyEvent:
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
        if self._loop is not None and not self._loop.is_closed():
            self._unwatch(self._socket)
        if self._guard is not None:
            self._guard.close()
        self._socket.close(linger=0)
        self._listener.close()
        if self._auth is not None:
            self._auth.stop()


def _listen(host: str, port: int) -> socket.socket:
    """The bus's listening TCP socket (non-blocking: every ZMQ socket serving it accepts in its I/O thread)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's own listeners
        listener.bind((host, port))
        listener.listen(100)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener
