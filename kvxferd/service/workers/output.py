"""A worker's stderr, relayed into the daemon's log as data, never as the daemon's own lines.

A worker may be owned by a peer (through its NIXL metadata): what it writes is untrusted. Written
straight to the daemon's stderr, it could print lines that look like the daemon's own records (a fake
"engine registered", a fake audit line). So the supervisor gives each worker a pipe and this thread
turns every line into one field of a record of its own::

    worker stderr ──pipe──► relay thread ──► log.warning("worker output", worker=<name>, line=<text>)
                            os.read(64 KiB): lines in pieces of at most MAX_LINE_BYTES; past
                            LINES_PER_S the rest are counted (bytes.count, no per-line Python work)
                            and said every DROPPED_REPORT_S; the pipe is always drained

The thread never stops reading: a worker blocked on a full pipe would stop polling its agent. A
flood costs the daemon one ``os.read`` and one ``bytes.count`` per 64 KiB.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import BinaryIO

log = logging.getLogger("kvxferd.workers")
MAX_LINE_BYTES = 2000
LINES_PER_S = 20.0  # sustained; BURST_LINES at once (a traceback, NIXL's lines at a failed start)
BURST_LINES = 200
CHUNK_BYTES = 64 << 10
DROPPED_REPORT_S = 10.0


class OutputRelay:
    """Relays one worker generation's stderr until its end of file."""

    def __init__(self, stream: BinaryIO, worker: str) -> None:
        self.stream, self.worker = stream, worker
        self.num_lines = self.num_dropped = 0
        self._reported_dropped, self._reported_s = 0, time.monotonic()
        self._tokens, self._last_s = float(BURST_LINES), time.monotonic()
        self._partial = b""  # a line not ended yet (at most MAX_LINE_BYTES)
        self.thread = threading.Thread(target=self._run, name=f"kvxferd-output-{worker}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self.stream.fileno()
        try:
            while chunk := os.read(fd, CHUNK_BYTES):
                self._take(chunk)
            if self._partial:
                self._line(self._partial, cut=False)
        except OSError:  # closed under us at stop
            pass
        finally:
            self.stream.close()
            self._report_dropped(force=True)

    def _take(self, chunk: bytes) -> None:
        now = time.monotonic()
        self._tokens = min(float(BURST_LINES), self._tokens + (now - self._last_s) * LINES_PER_S)
        self._last_s = now
        if self._tokens < 1.0:  # a flood: count its lines without looking at them
            self.num_dropped += chunk.count(b"\n")
            self._partial = b""
            self._report_dropped()
            return
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            while len(line) > MAX_LINE_BYTES:
                self._line(line[:MAX_LINE_BYTES], cut=True)
                line = line[MAX_LINE_BYTES:]
            self._line(line, cut=False)
        while len(self._partial) > MAX_LINE_BYTES:  # a line without end: in pieces
            self._line(self._partial[:MAX_LINE_BYTES], cut=True)
            self._partial = self._partial[MAX_LINE_BYTES:]
        self._report_dropped()

    def _line(self, raw: bytes, *, cut: bool) -> None:
        if self._tokens < 1.0:
            self.num_dropped += 1
            return
        self._tokens -= 1.0
        self.num_lines += 1
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        log.warning("worker output", extra={"worker": self.worker, "line": line, "cut": cut})

    def _report_dropped(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.num_dropped > self._reported_dropped and (force or now - self._reported_s >= DROPPED_REPORT_S):
            log.warning("worker output dropped", extra={"worker": self.worker,
                                                        "dropped_lines": self.num_dropped - self._reported_dropped})
            self._reported_dropped, self._reported_s = self.num_dropped, now

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
