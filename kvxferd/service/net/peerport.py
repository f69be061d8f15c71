"""What the peer port gives a caller before a call is authenticated: small HTTP/2 limits and a connection cap.

A peer call is authenticated by its handler (the peer token, or the certificate's
identity against ``peer_allowed_ids``), so gRPC reads the whole request first.
Issue #53 (L2): 15 MiB requests, refused by the 1 MiB ``max_peer_request_bytes``,
grew a daemon by ~420 MiB and left ~750 MiB behind. What was measured here
(grpcio 1.85, tests/security/test_peer_port_memory.py):

* ``grpc.http2.bdp_probe`` (on by default) grows a connection's flow-control
  windows to what the link carries, so a client sends megabytes on every stream
  before the server's RESOURCE_EXHAUSTED arrives. Off, the windows stay at 64 KiB:
  16 connections x 16 streams of 15 MiB grew a test server 3 MiB instead of 216.
  Peers send small requests; the replies (the server sends) do not depend on it.
* A request under the limit that never ends (a length prefix, then part of the
  message) is held: gRPC opens the window to let a started message finish. So a
  connection holds at most ``PEER_HTTP2_STREAMS`` x ``max_peer_request_bytes``
  before anything is authenticated, and the streams are few.
* ``grpc.max_metadata_size`` / ``grpc.absolute_max_metadata_size``: headers past 8 KiB
  are refused (default: 16 KiB); peers send a token and nonces.
* ``grpc.server_handshake_timeout_ms``: a connection that completes neither TLS nor
  the HTTP/2 preface is closed after 5 s (default 120 s); ``grpc.max_connection_idle_ms``:
  one with no call for 60 s is closed (GOAWAY: a peer's channel reconnects by itself).
* ``grpc.http2.lookahead_bytes`` and ``grpc.http2.max_frame_size`` changed nothing
  measurable (the window is 64 KiB and the frame 16 KiB already with BDP off), so
  they are left alone.

gRPC's Python server has no per-address connection limit and cannot be handed
accepted sockets (an accepting front that relayed the bytes would hide the
caller's address from the audit log and add a hop to every call). So
:class:`ConnectionCap` asks the kernel which connections the port has
(:mod:`kvxferd.wire.connections`: about 2.5 ms for the table walk, in a worker
thread) when this process's file descriptors grew since the last walk (an
accepted connection is one of them; counting them costs tens of microseconds,
so a daemon whose peers only call on their open connections, as probes do,
walks nothing), looked at every ``CAP_CHECK_S`` and when a call arrives (at
most every ``MIN_CHECK_GAP_S``), and every ``FULL_CHECK_S`` regardless; it
shuts down, per **source** (the remote address; on
loopback the uid that made the connecting end, as the kernel says), the newest
past ``max_peer_connections_per_source``; gRPC sees them end and frees their
streams, and freed heap goes back to the system (``malloc_trim``). Measured
with a cap of 16: 64 connections x 32 streams holding 1 MiB requests grew a
daemon 64-68 MiB (before: 1.3-1.9 GiB). A handshake's time did not change
(p50 8.9 ms against 9.4 before, two prefill ranks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable

import grpc

from kvxferd.wire.connections import (TCP_ESTABLISHED, TcpConnection, listener_families, shut_down_own_sockets,
                                      tcp_connections, tcp_socket_uid)

log = logging.getLogger("kvxferd.daemon")
PEER_HTTP2_STREAMS = 4  # calls at once per peer connection (more wait in the caller's channel)
MAX_PEER_METADATA_BYTES = 8 << 10
CAP_CHECK_S = 1.0
FULL_CHECK_S = 10.0  # the table is walked at least this often, whatever the fd count says
MIN_CHECK_GAP_S = 0.25  # calls arriving make a check happen at once, but not more often than this
LOG_EVERY_S = 10.0


def peer_server_options() -> list[tuple[str, int]]:
    """gRPC server options of the peer port, on top of the message limits (module doc: what each does here)."""
    return [("grpc.http2.bdp_probe", 0),
            ("grpc.max_concurrent_streams", PEER_HTTP2_STREAMS),
            ("grpc.max_metadata_size", MAX_PEER_METADATA_BYTES // 2),
            ("grpc.absolute_max_metadata_size", MAX_PEER_METADATA_BYTES),
            ("grpc.server_handshake_timeout_ms", 5_000),
            ("grpc.max_connection_idle_ms", 60_000)]


class ConnectionCap(grpc.aio.ServerInterceptor):
    """At most ``max_per_source`` connections on ``port`` per source; the newest past it are shut down.

    Looked at every ``CAP_CHECK_S``, and at once (at most every ``MIN_CHECK_GAP_S``) when a call arrives: as
    the peer server's interceptor it sees each call's headers before gRPC reads the request.
    """

    def __init__(self, max_per_source: int, on_shut: Callable[[int], None] = lambda n: None) -> None:
        self.port, self.families = 0, ()  # set once the port is bound (run), and its listeners found
        self.max_per_source, self.on_shut = max_per_source, on_shut
        self._seen: dict[int, tuple[int, object]] = {}  # inode -> (the look that first saw it, its source)
        self._looks = 0
        self._due: asyncio.Event | None = None
        self._checked_s = 0.0
        self.num_shut = 0

    async def intercept_service(self, continuation, handler_call_details):
        if self._due is not None and time.monotonic() - self._checked_s >= MIN_CHECK_GAP_S:
            self._due.set()
        return await continuation(handler_call_details)

    def over_cap(self) -> set[int]:
        """The inodes of the connections past the cap (blocking: the kernel's table is walked). The newest go:
        those first seen at the latest look (inode numbers are not in creation order across CPUs)."""
        self._looks += 1
        connections = self._established()
        self._seen = {c.inode: self._seen.get(c.inode) or (self._looks, self._source(c)) for c in connections}
        by_source: dict[object, list[TcpConnection]] = collections.defaultdict(list)
        for connection in connections:
            by_source[self._seen[connection.inode][1]].append(connection)
        over = set()
        for members in by_source.values():
            if len(members) > self.max_per_source:
                members.sort(key=lambda c: (self._seen[c.inode][0], c.inode))
                over |= {c.inode for c in members[self.max_per_source:]}
        return over

    def _source(self, connection: TcpConnection) -> object:
        remote = connection.remote[0]
        mapped = getattr(remote, "ipv4_mapped", None)
        if (mapped or remote).is_loopback:
            try:
                uid = tcp_socket_uid((str(remote), connection.remote[1]), (str(connection.local[0]), self.port))
            except (OSError, ValueError):
                uid = None
            if uid is not None:
                return f"uid {uid}"
        return str(mapped or remote)

    def check(self) -> int:
        """Shut down the connections past the cap; how many (blocking). Memory their calls held goes back to
        the system (glibc keeps freed memory otherwise: the audit saw 750 MiB stay)."""
        shut = shut_down_own_sockets(self.over_cap())
        self.num_shut += shut
        if shut:
            _trim_heap()
        return shut

    def _established(self) -> list[TcpConnection]:
        """The port's established connections (blocking: the kernel's table is walked). Established only: a
        connection shut down at an earlier look lingers half-closed until gRPC lets go."""
        if not self.families:
            self.families = listener_families(self.port)
        return [c for c in tcp_connections(self.port, families=self.families) if c.state == TCP_ESTABLISHED]

    def shut_all(self) -> int:
        """Shut down every connection on the port (blocking); how many. For a CA withdrawn from the bundle:
        a connection's peer was checked against the old one at its TLS handshake, so each peer must
        connect again (gRPC channels do by themselves) and prove its certificate anew."""
        return shut_down_own_sockets({c.inode for c in self._established()}) if self.port else 0

    async def run(self, port: int) -> None:
        """Check ``port`` every ``CAP_CHECK_S``, or sooner when a call arrives, off the event loop, until
        cancelled. Where the kernel cannot be asked, say so once and stop (no cap then)."""
        self.port, self._due = port, asyncio.Event()
        logged_s, walked_fds = -LOG_EVERY_S, -1
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._due.wait(), CAP_CHECK_S)
            self._due.clear()
            if _num_fds() <= walked_fds and time.monotonic() - self._checked_s < FULL_CHECK_S:
                continue  # no connection can have been accepted since the last walk (a call only wakes us sooner)
            self._checked_s = time.monotonic()
            try:
                shut = await asyncio.to_thread(self.check)
            except OSError as err:
                log.warning("peer port: no connection cap (the kernel's socket table cannot be asked)",
                            extra={"error": str(err)})
                self._due = None
                return
            walked_fds = _num_fds()
            if shut:
                self.on_shut(shut)
                if time.monotonic() - logged_s >= LOG_EVERY_S:
                    logged_s = time.monotonic()
                    log.warning("peer port: connections past max_peer_connections_per_source were closed",
                                extra={"closed": shut, "max_peer_connections_per_source": self.max_per_source})


def _num_fds() -> int:
    """This process's open file descriptors (a connection gRPC accepted is one)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 1 << 30  # cannot tell: walk the table every time


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
