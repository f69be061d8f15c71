"""A worker's stderr, relayed into the daemon's log as data, never as the daemon's own lines.

A worker may be owned by a peer (through its NIXL metadata): what it writes is untrusted. Written
straight to the daemon's stderr, it could print lines that look like the daemon's own records (a fake
"engine registered", a fake audit line). So the supervisor gives each worker a pipe and this thread
turns every line into one field of a record of its own::

    worker stderr ──pipe──► relay thread ──► log.warning("worker output", worker=<name>, line=<text>)
                                            (longer lines in pieces of MAX_LINE_BYTES; past LINES_PER_S the
                                             rest are counted, not logged; the pipe is always drained)

The thread never stops reading: a worker blocked on a full pipe would stop polling its agent.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import BinaryIO

log = logging.getLogger("kvxferd.workers")
MAX_LINE_BYTES = 2000
LINES_PER_S = 20.0  # sustained; BURST_LINES at once (a traceback, NIXL's lines at a failed start)
BURST_LINES = 200


class OutputRelay:
    """Relays one worker generation's stderr until its end of file."""

    def __init__(self, stream: BinaryIO, worker: str) -> None:
        self.stream, self.worker = stream, worker
        self.num_lines = self.num_dropped = 0
        self._tokens, self._last_s = float(BURST_LINES), time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"kvxferd-output-{worker}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            # Bounded reads: a worker writing without newlines must not grow this thread's memory.
            while raw := self.stream.readline(MAX_LINE_BYTES):
                self._relay(raw)
        except (OSError, ValueError):  # closed under us at stop
            pass
        finally:
            self.stream.close()
            if self.num_dropped:
                log.warning("worker output dropped", extra={"worker": self.worker, "dropped_lines": self.num_dropped})

    def _relay(self, raw: bytes) -> None:
        now = time.monotonic()
        self._tokens = min(float(BURST_LINES), self._tokens + (now - self._last_s) * LINES_PER_S)
        self._last_s = now
        if self._tokens < 1.0:
            self.num_dropped += 1
            return
        self._tokens -= 1.0
        self.num_lines += 1
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        log.warning("worker output", extra={"worker": self.worker, "line": line,
                                            "cut": not raw.endswith(b"\n") and len(raw) == MAX_LINE_BYTES})

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
