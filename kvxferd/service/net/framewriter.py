"""Frames onto a stream socket from the event loop or the data-plane thread, in the order written.

A read that ends on the data-plane thread used to reach its engine through
the event loop: wake the loop (a syscall of 60-75 µs here), let it run the
completion, then let the session's sender task write it, about 0.2 ms in
all (docs/benchmarks.md). The thread now writes an ok read's completion to
the engine's reads socket itself. Two threads writing one socket need one
writer that keeps their frames whole and in order::

    write(frame)  any thread, under the lock
      nothing buffered ─► send() now (non-blocking) ─► all taken: done
                                                   └► the rest buffered
      something buffered ─► appended behind it
    buffered bytes ─► the loop sends them when the socket is writable
                      (add_writer), then the next writer goes straight again

The writer sends on its own duplicate of the connection's descriptor, so a
thread never writes to a descriptor number the loop closed and the kernel
gave to something else. The asyncio transport keeps reading the connection
and never writes to it. Over ``high_water_bytes`` buffered, :attr:`writable`
turns false: the session stops taking completions until the engine reads
(nothing is dropped; unacked completions stay queued in the feed).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable

CLOSE_FLUSH_S = 5.0  # how long a closing writer waits for the engine to take its last frames


class FrameWriter:
    """A thread-safe writer of byte strings onto one connection (create it on the event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, *, high_water_bytes: int,
                 on_broken: Callable[[OSError], None]) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        # Reentrant: on the loop's thread, work it asks of the loop runs at once, inside the lock.
        self._lock = threading.RLock()
        self._buffer = bytearray()  # what the socket has not taken yet; sent by the loop, in order
        self._high_water_bytes = high_water_bytes
        self._on_broken = on_broken
        self._closed = False
        self._watching = False  # loop side: add_writer is on
        self._when_flushed: Callable[[], None] | None = None
        self._drained = asyncio.Event()  # loop side: set while writable (or closed)
        self._drained.set()

    @property
    def writable(self) -> bool:
        """Few enough bytes buffered to take more (any thread)."""
        return not self._closed and len(self._buffer) <= self._high_water_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buffer)

    async def wait_writable(self) -> None:
        """Until the engine has read enough of what is buffered, or the writer closed (event loop)."""
        await self._drained.wait()

    def write(self, data: bytes) -> bool:
        """Send ``data`` after everything written before (any thread); False once closed or broken."""
        with self._lock:
            if self._closed:
                return False
            if not self._buffer:
                sent = self._send_locked(data)
                if sent is None:
                    return False
                if sent == len(data):
                    return True
                self._buffer += memoryview(data)[sent:]
                self._on_loop(self._watch)  # the buffer was empty: nobody watches for room yet
            else:
                self._buffer += data
            if len(self._buffer) > self._high_water_bytes:
                self._on_loop(self._drained_changed)
        return True

    def close(self) -> None:
        """Drop what is buffered; no write goes out after this (any thread)."""
        with self._lock:
            self._close_locked()

    def close_when_flushed(self, then: Callable[[], None]) -> None:
        """Close once everything buffered is sent (or after CLOSE_FLUSH_S), then call ``then`` (event loop)."""
        with self._lock:
            if self._buffer and not self._closed:
                self._when_flushed = then
                self._loop.call_later(CLOSE_FLUSH_S, self._close_and_call_back)  # the engine may never read
                return
            self._close_locked()
        then()

    # ---- internals (event loop unless said otherwise) ------------------------------------
    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop: now when called there, else soon (any thread)."""
        if threading.get_ident() == self._loop_thread:
            fn()
        else:
            self._later(fn)

    def _later(self, fn: Callable[..., None], *args) -> None:
        """Run ``fn`` in a later step of the loop (any thread)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed: the daemon is stopping, nothing is written any more
            pass

    def _send_locked(self, data) -> int | None:
        """Under the lock: bytes the socket took now (0 when full); None when the connection is gone."""
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as err:  # the engine went away: the session ends
            self._break(err)
            return None

    def _watch(self) -> None:
        with self._lock:
            if not self._closed and self._buffer and not self._watching:
                self._watching = True
                self._loop.add_writer(self._sock.fileno(), self._flush)

    def _flush(self) -> None:
        with self._lock:
            if self._closed or (sent := self._send_locked(self._buffer)) is None:
                return
            del self._buffer[:sent]
            self._drained_changed()
            if self._buffer:
                return
            self._watching = False
            self._loop.remove_writer(self._sock.fileno())
            closing = self._when_flushed is not None
        if closing:
            self._close_and_call_back()

    def _close_and_call_back(self) -> None:
        """Close, then call what :meth:`close_when_flushed` was given (once): everything was sent, or
        the engine did not take it within CLOSE_FLUSH_S."""
        with self._lock:
            then, self._when_flushed = self._when_flushed, None
            self._close_locked()
        if then is not None:
            then()

    def _drained_changed(self) -> None:
        if self.writable or self._closed:
            self._drained.set()
        else:
            self._drained.clear()

    def _break(self, err: OSError) -> None:
        """Under the lock (any thread): the connection is gone; tell the session on the loop, in a later
        step (never inside a caller's locks)."""
        self._close_locked()
        self._later(self._on_broken, err)

    def _close_locked(self) -> None:
        """Under the lock (any thread). The descriptor is closed on the loop, after add_writer is off: an
        epoll registration of a closed duplicate would go on firing while the connection stays open."""
        if not self._closed:
            self._closed = True
            self._buffer.clear()
            self._on_loop(self._release)

    def _release(self) -> None:
        with self._lock:
            if self._watching:
                self._watching = False
                self._loop.remove_writer(self._sock.fileno())
            self._sock.close()
        self._drained.set()
