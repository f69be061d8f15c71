"""A replaced worker generation's last stretch: it serves on until its successor is up and a grace has
passed, then it is stopped (issue #55 item 3, docs/dataplane.md).

::

    replace ──► successor up ──► + grace_s ──► stop ──► end of file (killed after STOP_TIMEOUT_S)
                (or max_wait_s: a successor that never comes up does not keep it alive)

Its channel is read to the end: notices of readers that have not handshaken
again yet still reach the control plane. The generation's end is reported
with whether its stop had been sent: one that ended before was a death
(SIGSEGV, an abort), the supervisor counts it as one.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.wire import workerchannel as channel

log = logging.getLogger("kvxferd.workers")
STOP_TIMEOUT_S = 5.0
CHECK_S = 0.2  # how often it looks whether its successor is up (a threading.Event cannot be selected)


@dataclass(frozen=True)
class WorkerReplaced:
    """A generation replaced on purpose (trust in its metadata ended), and when it was gone."""

    generation: int
    pid: int
    reasons: tuple[str, ...]
    ended_s: float  # time.monotonic() when its channel ended


class Retiring:
    """One replaced generation, read and stopped on a thread of its own (:meth:`start`)."""

    def __init__(self, name: str, generation: int, sock: socket.socket, process: subprocess.Popen, relay,
                 reasons: tuple[str, ...], *, take: Callable[[dict], None], successor_up: threading.Event,
                 stopping: threading.Event, grace_s: float, max_wait_s: float,
                 on_end: Callable[["Retiring", bool, int], None]) -> None:
        """``take`` each message it sends (raises: out of protocol, it is killed); ``on_end(self, stop_sent,
        returncode)`` once it is gone."""
        self.name, self.generation, self.sock, self.process, self.relay = name, generation, sock, process, relay
        self.reasons, self.take, self.successor_up, self.stopping = reasons, take, successor_up, stopping
        self.grace_s, self.max_wait_s, self.on_end = grace_s, max_wait_s, on_end
        self.thread = threading.Thread(target=self._run, name=f"kvxferd-retire-{name}-w{generation}", daemon=True)
        self._send_lock = threading.Lock()  # the stop and the close against send() from other threads
        self._stop_sent = False

    def start(self) -> None:
        self.thread.start()

    def send(self, message: dict, fds=()) -> bool:
        """A command it does not answer (a reader's notices, while holders know its notice agent), never
        blocking; False once its stop was sent (or its channel is full or gone)."""
        with self._send_lock:
            if self._stop_sent:
                return False
            try:
                channel.send(self.sock, message, fds, block=False)
            except (BlockingIOError, channel.ChannelClosed, OSError):
                return False
            return True

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def _stop_at(self, started_s: float, now: float, up_s: float | None) -> float:
        if self.stopping.is_set():
            return now
        if up_s is not None:
            return up_s + self.grace_s
        return started_s + self.max_wait_s

    def _run(self) -> None:
        started_s, up_s, end_by_s, stop_sent = time.monotonic(), None, None, False
        try:
            while True:
                now = time.monotonic()
                if up_s is None and self.successor_up.is_set():
                    up_s = now
                if not stop_sent and now >= self._stop_at(started_s, now, up_s):
                    stop_sent, end_by_s = True, now + STOP_TIMEOUT_S
                    with self._send_lock:
                        self._stop_sent = True
                        with contextlib.suppress(BlockingIOError):  # full: it reads nothing; killed at end_by_s
                            channel.send(self.sock, {"op": "stop"}, block=False)
                if end_by_s is not None and now >= end_by_s:
                    log.error("worker %s generation %d ignored its stop; killing it", self.name, self.generation)
                    self.process.kill()
                    break
                wait_s = CHECK_S if end_by_s is None else min(CHECK_S, end_by_s - now)
                if select.select([self.sock], [], [], max(0.0, wait_s))[0]:
                    message, fds = channel.receive(self.sock)
                    channel.close_all(fds)
                    self.take(message)
        except channel.ChannelClosed:
            pass
        except Exception as err:  # noqa: BLE001 - out of protocol: it goes now
            log.error("worker %s generation %d (replaced): %s; killing it", self.name, self.generation,
                      getattr(err, "message", None) or f"{type(err).__name__}: {err}")
            self.process.kill()
        with self._send_lock:
            self._stop_sent = True
            self.sock.close()
        try:
            returncode = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            returncode = self.process.wait()
        if self.relay is not None:
            self.relay.join(1.0)
        # stop() ends the supervisor's thread, and with it (PR_SET_PDEATHSIG) the worker: asked for too.
        self.on_end(self, stop_sent or self.stopping.is_set(), returncode)
