"""What each subscriber connection sent the notify bus: a flooder's connections are closed, and only its.

libzmq files every subscription a connection sends (about 12 KiB for a
257-byte topic, applied or not) as fast as it arrives, whether or not the
application reads it, until that connection ends; it tells the application
neither which connection sent one nor how to close one; and ending one
connection walks everything filed for all of them (about 0.25 µs a byte of
topic per connection ended). The bus used to start over after
``max_bus_subscriptions``, dropping every subscriber: one flooder sent every
engine's events through ``MissedEvents`` (issue #53, CONSUMED p50 10.8 ->
203 ms).

Now libzmq's socket monitor names each accepted connection's fd, and the
kernel says what each connection sent (``tcpi_bytes_received``, at least what
libzmq filed) and, on loopback, which uid made its connecting end
(:func:`kvxferd.wire.connections.tcp_socket_uid`). That uid, or off loopback
the remote address, is the connection's **source**. The bus looks often (every
``CHECK_EVERY`` messages, and every ``CHECK_INTERVAL_S`` while they come, never more than
1 / ``CHECK_COST_FACTOR`` of the time):

* a connection that sent more than ``MAX_CONNECTION_BYTES`` (an engine's
  subscriber sends one topic: a few hundred bytes with the handshake) is shut
  down, so what libzmq filed stays small and ending it is cheap; and its
  source is **refused** for a while: each of its new connections is shut down
  as it is accepted, before it sends anything, for 1 s, then 2, 4, ... up to
  ``MAX_REFUSAL_S`` while it goes on (a source quiet for ``MAX_REFUSAL_S``
  starts at 1 s again);
* when all connections together (each charged ``CONNECTION_CHARGE`` more:
  idle connections are not free) pass the bus's budget, the heaviest sources
  are refused and their connections shut down until they are under it; if
  that is more than ``MAX_SHUT_AT_ONCE`` connections, the bus starts over
  instead (one walk instead of many: every subscriber reconnects, the refused
  sources are refused as they do).

An engine's subscriber keeps its connection and gets its events live unless it
shares its source (its uid) with the flooder.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import socket
import struct
import time

import zmq

from kvxferd.wire.connections import tcp_socket_uid

log = logging.getLogger("kvxferd.bus")
MAX_CONNECTION_BYTES = 16 << 10  # what one connection may send in its life: ~60 of the longest topics, ~500 short
CONNECTION_CHARGE = 512  # bytes charged per connection on top of what it sent
MAX_SHUT_AT_ONCE = 8  # more connections to end at once: the bus starts over (each ending walks all of libzmq's table)
CHECK_INTERVAL_S = 0.01
# A look costs about 5 µs a connection: the next one waits at least this many times what the last took, so
# that many idle connections and a trickle of subscriptions cannot keep the loop looking.
CHECK_COST_FACTOR = 20
FIRST_REFUSAL_S, MAX_REFUSAL_S = 1.0, 64.0
MAX_SOURCES = 4096  # sources remembered (refusals); the oldest are forgotten past it
_TCP_INFO_BYTES = 136  # up to and including tcpi_bytes_received (Linux 4.1+)
_BYTES_RECEIVED = struct.Struct("=Q")
_EVENT = struct.Struct("=Hi")  # a monitor message's first frame: event id, value (the fd)


class Subscriber:
    """One accepted connection: libzmq's fd, the socket's inode, its source, its charge at the last look."""

    __slots__ = ("fd", "inode", "source", "charge")

    def __init__(self, fd: int, inode: int, source: object) -> None:
        self.fd, self.inode, self.source, self.charge = fd, inode, source, 0


class SubscriberGuard:
    """Follows one XPUB socket's connections (its monitor), charges them, refuses flooding sources.

    Event-loop thread only, like the bus. :meth:`check` raises OSError where the kernel or libzmq cannot
    say (the bus then falls back to starting over).
    """

    def __init__(self, xpub: zmq.Socket, port: int, budget_bytes: int, refusals: dict | None = None) -> None:
        """``refusals``: the previous socket's, when the bus starts over (refused sources stay refused)."""
        self.xpub, self.port, self.budget_bytes = xpub, port, budget_bytes
        self.monitor = xpub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.subscribers: dict[int, Subscriber] = {}  # by libzmq's fd
        # source -> (refused until (monotonic), the next refusal's length, the last offence (monotonic))
        self.refusals: collections.OrderedDict = collections.OrderedDict(refusals or {})
        self.num_shut = 0  # connections shut down, on accept or for what they sent
        self.last_check_s = 0.0
        self.last_check_cost_s = 0.0

    def fileno(self) -> int:
        """The monitor's ZMQ_FD (edge-triggered: :meth:`take_events` drains it)."""
        return self.monitor.getsockopt(zmq.FD)

    def take_events(self) -> int:
        """Follow accepts and disconnects (never blocks); shut down what a refused source opens. How many."""
        shut = 0
        while True:
            try:
                head, _endpoint = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self.num_shut += shut
                return shut
            if len(head) != _EVENT.size:
                continue
            event, fd = _EVENT.unpack(head)
            self.subscribers.pop(fd, None)  # closed, or its number taken by a new connection
            if event != zmq.EVENT_ACCEPTED:
                continue
            subscriber = _inspect(fd, self.port)
            if subscriber is None:
                continue
            if self._refused(subscriber.source):
                shut += _shut_down(subscriber)
            else:
                self.subscribers[fd] = subscriber

    def due(self, num_taken: int, every: int) -> bool:
        """Whether to look now, ``num_taken`` messages after the last look (at least every ``every``, or
        every ``CHECK_INTERVAL_S``, but never more than 1 / ``CHECK_COST_FACTOR`` of the time)."""
        since_s = time.monotonic() - self.last_check_s
        return ((num_taken >= every or since_s >= CHECK_INTERVAL_S)
                and since_s >= CHECK_COST_FACTOR * self.last_check_cost_s)

    def check(self) -> tuple[int, bool]:
        """Charge every connection; shut down what is over its or the bus's budget. (connections shut down,
        whether the bus must start over instead)."""
        started_s = time.monotonic()
        try:
            return self._check()
        finally:
            self.last_check_cost_s = time.monotonic() - started_s

    def _check(self) -> tuple[int, bool]:
        shut = self.take_events()
        self.num_shut -= shut  # counted again below, with the rest
        self.last_check_s = now = time.monotonic()
        total, offenders = 0, []
        for fd, subscriber in list(self.subscribers.items()):
            received = _bytes_received(subscriber)
            if received is None:  # gone, or the fd is another socket's now
                del self.subscribers[fd]
            elif received > MAX_CONNECTION_BYTES:
                offenders.append(subscriber)
            else:
                subscriber.charge = received + CONNECTION_CHARGE
                total += subscriber.charge
        for subscriber in offenders:
            self._refuse(subscriber.source, now)
            del self.subscribers[subscriber.fd]
            shut += _shut_down(subscriber)
        to_shut = self._heaviest_past_budget(total, now)
        if len(to_shut) > MAX_SHUT_AT_ONCE:
            self.num_shut += shut
            return shut, True
        for subscriber in to_shut:
            del self.subscribers[subscriber.fd]
            shut += _shut_down(subscriber)
        self.num_shut += shut
        return shut, False

    def _heaviest_past_budget(self, total: int, now: float) -> list[Subscriber]:
        """Refuse the heaviest sources until the rest is within the budget; their connections."""
        by_source: dict[object, list[Subscriber]] = collections.defaultdict(list)
        for subscriber in self.subscribers.values():
            by_source[subscriber.source].append(subscriber)
        charges = {source: sum(s.charge for s in conns) for source, conns in by_source.items()}
        chosen = []
        for source in sorted(charges, key=charges.get, reverse=True):
            if total <= self.budget_bytes:
                break
            self._refuse(source, now)
            chosen += by_source[source]
            total -= charges[source]
        return chosen

    def _refused(self, source: object) -> bool:
        refusal = self.refusals.get(source)
        return refusal is not None and time.monotonic() < refusal[0]

    def _refuse(self, source: object, now: float) -> None:
        """Refuse ``source``'s new connections for the next length (doubling while it goes on)."""
        _until, length, last = self.refusals.pop(source, (0.0, FIRST_REFUSAL_S, 0.0))
        if now - last > MAX_REFUSAL_S:  # quiet for long: forgiven
            length = FIRST_REFUSAL_S
        self.refusals[source] = (now + length, min(2 * length, MAX_REFUSAL_S), now)
        while len(self.refusals) > MAX_SOURCES:
            self.refusals.popitem(last=False)
        log.info("notify bus: a source sent more than its share; its new connections are refused",
                 extra={"source": str(source), "refused_s": length})

    def close(self) -> None:
        """Stop following (before the XPUB socket closes: libzmq does not end it while its monitor is on)."""
        self.xpub.disable_monitor()
        self.monitor.close(linger=0)


@contextlib.contextmanager
def _duplicate(fd: int):
    """A socket object on a duplicate of libzmq's ``fd`` (closed after; libzmq's own fd is untouched)."""
    duplicate = os.dup(fd)
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        raise
    with sock:
        yield sock


def _inspect(fd: int, port: int) -> Subscriber | None:
    """The connection behind libzmq's ``fd`` if it is still a TCP connection on the bus's port, with its source:
    on loopback the uid that made its connecting end, else the remote address."""
    try:
        with _duplicate(fd) as sock:
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                return None
            local, remote = sock.getsockname()[:2], sock.getpeername()[:2]
            inode = os.fstat(sock.fileno()).st_ino
    except OSError:
        return None
    source: object = remote[0]
    address = ipaddress.ip_address(remote[0])
    if (getattr(address, "ipv4_mapped", None) or address).is_loopback:
        try:
            uid = tcp_socket_uid(remote, local)
        except OSError:
            uid = None  # no netlink: loopback is one source
        source = f"uid {uid}" if uid is not None else remote[0]
    return Subscriber(fd, inode, source)


def _bytes_received(subscriber: Subscriber) -> int | None:
    """What the peer sent on this connection so far; None when libzmq's fd is no longer this connection."""
    try:
        with _duplicate(subscriber.fd) as sock:
            if os.fstat(sock.fileno()).st_ino != subscriber.inode:
                return None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES:
        raise OSError("tcp_info has no tcpi_bytes_received (Linux before 4.1)")
    return _BYTES_RECEIVED.unpack_from(info, _TCP_INFO_BYTES - _BYTES_RECEIVED.size)[0]


def _shut_down(subscriber: Subscriber) -> int:
    """Shut the connection down through a duplicate of libzmq's fd, if that fd is still this connection."""
    try:
        with _duplicate(subscriber.fd) as sock:
            if os.fstat(sock.fileno()).st_ino != subscriber.inode:
                return 0
            sock.shutdown(socket.SHUT_RDWR)
            return 1
    except OSError:
        return 0
