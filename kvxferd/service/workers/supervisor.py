"""One engine rank's worker, kept running: started clean, watched, started again when it dies.

::

    supervisor thread                               worker (generation g)
    ─────────────────                               ─────────────────────
    socketpair, exec ─────────────────────────────► python -m kvxferd.worker
    map {name-w<g>, regions} + the kept fds ──────► mmap, NIXL agent, register
                      ◄──────────────────────────── mapped {metadata, addresses}   -> WorkerUp
                      ◄──────────────────────────── notices (checked: workerchannel.notices_of)
    end of file (it died: SIGSEGV, UCX abort, OOM) -> WorkerDeath, seen at once;
    after restart_delay_s: generation g+1 with the same fds (the engine's memory is not asked for again)
    (a worker that keeps dying is started again after a growing pause: backoff_s, never given up on)

    replace(reason) (trust in metadata peers were handed ended: docs/dataplane.md), make before break:
    generation g serves on ─────────────────────────────────────────► stop, retire_grace_s after g+1 is up
    generation g+1: exec, map ──► up: sends and peer_view switch to it (peers re-handshake at their probe)
    (at most one replacement per min_replace_interval_s; requests meanwhile are folded into the next)

The supervisor keeps its own duplicate of every region's fd, so a new
worker maps the same pages. Everything a worker sends is untrusted (it may
be owned through its metadata): a message out of protocol kills it, and
the next generation starts. The one thread spawns every generation, so
``PR_SET_PDEATHSIG`` (the worker dies with the thread that started it)
ties workers to the supervisor, not to whichever thread called :meth:`start`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.service.workers.generation import (BACKOFF_BASE_S, FREE_RESTARTS, STABLE_S, Region, WorkerDeath,
                                                WorkerUp, backoff_s, read_only_copy)
from kvxferd.service.workers.output import OutputRelay
from kvxferd.service.workers.retire import STOP_TIMEOUT_S, Retiring, WorkerReplaced
from kvxferd.service.workers.spawn import spawn_worker
from kvxferd.wire import workerchannel as channel
from kvxferd.xfer.nixl.agent import agent_name_of

log = logging.getLogger("kvxferd.workers")
MAP_TIMEOUT_S = 60.0  # exec, import NIXL, map, register: about 2 s here (kvxferd bench processes)
CHANNEL_BUFFER_BYTES = 4 << 20  # each way: a new generation's reload of every holder's metadata fits
FULL_CHANNEL_S = 5.0  # a worker whose channel stays full this long has stopped reading it: killed
# A replaced generation keeps serving this long after its successor is up: readers notice the new
# incarnation at their next probe (peer_check_s) and re-handshake before their next read.
RETIRE_GRACE_S = 10.0
# Each replacement makes every reader of the rank handshake again: at most one per this interval.
MIN_REPLACE_INTERVAL_S = 30.0


READER_ANSWERS = frozenset({"connected", "probed", "ended"})
# What a reader worker serving the engine's session tells its control plane (service/net/sessions.py).
SESSION_EVENTS = frozenset({"session_calls", "session_notices", "session_stats", "need_handshake", "link_stale",
                            "capability_refused", "session_closed"})


class MapTimedOut(UnavailableError):
    """No answer to ``map`` in time (a loaded machine, a hung start): the next generation may do better."""


class WorkerSupervisor:
    """Keeps one worker for ``name``'s ``regions``; :meth:`start`, then :attr:`current`, :meth:`stop`."""

    def __init__(self, name: str, regions: Sequence[Region], *, poll_interval_s: float = 1e-3,
                 restart_delay_s: float = 0.0, free_restarts: int = FREE_RESTARTS,
                 backoff_base_s: float = BACKOFF_BASE_S, retire_grace_s: float = RETIRE_GRACE_S,
                 min_replace_interval_s: float = MIN_REPLACE_INTERVAL_S,
                 on_notices: Callable[[int, list[tuple[str, bytes]]], None] | None = None,
                 on_death: Callable[[WorkerDeath], None] | None = None,
                 on_up: Callable[[WorkerUp], None] | None = None,
                 on_replace: Callable[[tuple[str, ...]], None] | None = None,
                 reader: dict | None = None,
                 on_answer: Callable[[int, dict], None] | None = None,
                 on_retired: Callable[[int], None] | None = None) -> None:
        """``on_up``: each generation once it mapped, on the supervisor's thread, as the first thing sent
        to it (e.g. to load again what the last generation had loaded). ``on_replace``: the reasons of each
        replacement as it starts.

        ``reader``: a worker that posts the engine's READs (worker/reads.py) instead of serving them: what
        its ``map`` adds (the cache's description); it maps the engine's files read-write, and each of its
        answers (``connected``, ``probed``, ``ended``, an ``error`` naming a command's id) goes to
        ``on_answer`` with its generation. ``on_retired``: a replaced generation was stopped (its number), as
        asked: whatever it still had in flight ends with it."""
        if not regions:
            raise InvalidArgumentError("regions", "a worker maps at least one region")
        self.name, self.poll_interval_s = name, poll_interval_s
        self.restart_delay_s, self.free_restarts, self.backoff_base_s = restart_delay_s, free_restarts, backoff_base_s
        # One read-only copy per file (vLLM's layers share one object): ours until stop(). Regions name theirs.
        self._files: list[int] = []
        self._regions: list[tuple[int, int, int]] = []  # (file index, offset, num_bytes)
        known: dict[tuple[int, int], int] = {}
        try:
            for r in regions:
                status = os.fstat(r.fd)
                key = (status.st_dev, status.st_ino)
                if key not in known:
                    if len(self._files) == channel.MAX_FDS:
                        raise InvalidArgumentError("regions", f"more than {channel.MAX_FDS} files to map")
                    known[key] = len(self._files)
                    self._files.append(read_only_copy(r.fd) if reader is None else os.dup(r.fd))
                self._regions.append((known[key], r.offset, r.num_bytes))
        except BaseException:
            channel.close_all(self._files)
            raise
        self._on_notices, self._on_death, self._on_up, self._on_replace = on_notices, on_death, on_up, on_replace
        self._reader, self._on_answer, self._on_retired = reader, on_answer, on_retired
        self.retire_grace_s, self.min_replace_interval_s = retire_grace_s, min_replace_interval_s
        self._changed = threading.Condition()
        self._current: WorkerUp | None = None
        self.deaths: list[WorkerDeath] = []
        self.pauses_s: list[float] = []  # before each start after a death (backoff_s)
        self.replaced: list[WorkerReplaced] = []
        self.failure = ""  # set when the supervisor gave up: a generation could not map (the next would not)
        self._stopping = threading.Event()
        # The serving generation's (channel, process), published once it is up; sends go there (_send_lock).
        self._serving: tuple[socket.socket, subprocess.Popen] | None = None
        self._serving_generation = 0  # the generation number of _serving (0: none yet)
        self._send_lock = threading.Lock()
        # Held while a generation is published and its on_up sends: a sender that holds it too (WorkerNotices)
        # is never overtaken by, nor overtakes, those. Order: up_lock, then _send_lock.
        self.up_lock = threading.RLock()
        self._process: subprocess.Popen | None = None  # the newest one started (the thread's)
        self._full_since_s: float | None = None  # when a send first found the channel full (None: it is not)
        self._replace_reasons: list[str] = []  # asked for and not started yet (under _changed)
        self._last_replace_s = float("-inf")
        self._retiring: list[Retiring] = []
        self._wake_r, self._wake_w = socket.socketpair()  # replace() and stop() wake the thread
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"kvxferd-worker-{name}", daemon=True)

    # ---- API --------------------------------------------------------------
    def begin(self) -> None:
        """Start the first generation without waiting for it (:meth:`start` waits)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def start(self, timeout_s: float = MAP_TIMEOUT_S) -> WorkerUp:
        """Start the first generation; it once it mapped, else :class:`UnavailableError` (and stopped)."""
        self.begin()
        try:
            return self.wait_up(1, timeout_s)
        except UnavailableError:
            self.stop()
            raise

    @property
    def current(self) -> WorkerUp | None:
        """The generation serving now (None between a death and the next start)."""
        with self._changed:
            return self._current

    def wait_up(self, generation: int, timeout_s: float) -> WorkerUp:
        """The first generation at least ``generation`` once it is up."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._current is None or self._current.generation < generation:
                left = deadline - time.monotonic()
                if self.failure or self._stopping.is_set() or left <= 0:
                    raise UnavailableError("worker", f"worker {self.name!r} generation {generation} is not up: "
                                                     f"{self.failure or 'not within %.0f s' % timeout_s}")
                self._changed.wait(left)
            return self._current

    def send(self, message: dict, fds: Sequence[int] = ()) -> int:
        """Send the serving generation a command (and ``fds``, which stay the caller's), never blocking on
        the worker (the data-plane thread calls this). Between a death and the next generation nothing is sent (its
        on_up sends what it must know). A full channel drops the message; one full for FULL_CHANNEL_S
        (the worker stopped reading) kills the worker. The generation it went to; 0 (false) when not sent."""
        with self._send_lock:
            serving = self._serving
            if serving is None:
                return 0
            sock, process = serving
            try:
                channel.send(sock, message, fds, block=False)
            except BlockingIOError:
                now = time.monotonic()
                if self._full_since_s is None:
                    self._full_since_s = now
                elif now - self._full_since_s > FULL_CHANNEL_S:
                    log.error("worker %s has read nothing for %.0f s; killing it", self.name, now - self._full_since_s)
                    process.kill()
                return 0
            except (channel.ChannelClosed, OSError):
                return 0
            self._full_since_s = None
            return self._serving_generation

    @property
    def serving_generation(self) -> int:
        """The generation sends go to now (0 before the first is up)."""
        with self._send_lock:
            return self._serving_generation if self._serving is not None else 0

    def send_to(self, generation: int, message: dict, fds: Sequence[int] = ()) -> int | bool:
        """:meth:`send` to ``generation`` while it serves, or while it retires (a replaced generation serves
        its grace: what peers were introduced to still works); False when it is neither."""
        with self._send_lock:
            serving = self._serving is not None and self._serving_generation == generation
        if serving:
            sent = self.send(message, fds)
            return sent if sent == generation else False
        for retiring in list(self._retiring):
            if retiring.generation == generation:
                return retiring.send(message, fds)
        return False

    def replace(self, reason: str) -> None:
        """Replace the serving generation (make before break): a new one starts now, or once
        ``min_replace_interval_s`` passed since the last replacement; requests meanwhile are folded into
        it. The old one serves on until ``retire_grace_s`` after the new one is up, then it is stopped:
        the metadata peers were handed for it then names an agent that is gone."""
        with self._changed:
            if reason not in self._replace_reasons:
                self._replace_reasons.append(reason)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it is awake already; closed: stopped
            self._wake_w.send(b"w")

    def pace(self, poll_interval_s: float) -> None:
        """Have the worker poll its agent this often (this generation and the next ones); a no-op when
        unchanged, so a caller may say it every round."""
        if poll_interval_s != self.poll_interval_s:
            self.poll_interval_s = poll_interval_s
            self.send({"op": "pace", "poll_interval_s": poll_interval_s})  # dead: the next one starts at it

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the worker (asked; killed after ``timeout_s``) and the supervisor; close the kept fds."""
        self._stopping.set()
        self.send({"op": "stop"})
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            process = self._process
            if self._thread.is_alive() and process is not None:  # it ignored the stop (or hangs): it goes now
                process.kill()
                self._thread.join(timeout_s)
        for retiring in list(self._retiring):  # they saw _stopping: each sent its stop (killed after 5 s)
            retiring.join(2 * timeout_s)
        channel.close_all(self._files)
        self._files = []
        self._wake_r.close()
        self._wake_w.close()

    def forget_callbacks(self) -> None:
        """Drop the callbacks (after :meth:`stop`): what they refer to need not outlive the supervisor."""
        self._on_notices = self._on_death = self._on_up = self._on_replace = self._on_answer = None
        self._on_retired = None

    # ---- the thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            self._generations()
        except Exception as err:  # noqa: BLE001 - a supervisor that stops says why; peers get UNAVAILABLE
            self.failure = f"the supervisor failed: {type(err).__name__}: {err}"
            log.exception("worker %s: %s", self.name, self.failure)
            process = self._process
            if process is not None:
                process.kill()
            with self._send_lock:
                self._serving = None
            with self._changed:
                self._current = None
                self._changed.notify_all()

    def _generations(self) -> None:
        generation, streak = 0, 0
        while not self._stopping.is_set():
            generation += 1
            started_s = time.monotonic()
            death, refused = self._serve(generation)
            if death is None:  # replaced: it serves on (Retiring) while its successor starts, at once
                continue
            if refused:  # it never came up: the same fds would fail the same way again
                self.failure = refused
            self._died(death)
            if self._stopping.is_set() or self.failure:
                break
            log.warning("worker %s generation %d (pid %d) ended with %d; starting another", self.name,
                        generation, death.pid, death.returncode)
            streak = 1 if death.noticed_s - started_s >= STABLE_S else streak + 1
            pause_s = self.restart_delay_s + backoff_s(streak, self.free_restarts, self.backoff_base_s)
            self.pauses_s.append(pause_s)
            if pause_s >= 1.0:
                log.warning("worker %s: %d deaths in a row; the next starts in %.1f s", self.name, streak, pause_s)
            self._stopping.wait(pause_s)

    def _died(self, death: WorkerDeath) -> None:
        """A generation ended unasked (or never came up): no longer serving; counted; on_death told."""
        self.deaths.append(death)
        self._gone(death.generation, death.pid)
        if self._on_death is not None:
            self._on_death(death)

    def _gone(self, generation: int, pid: int) -> None:
        """Generation ``generation`` ended: if it was still the serving one, none is (until the next is up)."""
        with self._send_lock:
            if self._serving is not None and self._serving[1].pid == pid:
                self._serving = None
        with self._changed:
            if self._current is not None and self._current.generation == generation:
                self._current = None
            self._changed.notify_all()

    def _serve(self, generation: int) -> tuple[WorkerDeath | None, str]:
        """Run one generation until it ends: its death, and why it never came up ("" if it did); or until
        it is replaced: (None, ""), it serves on as a :class:`Retiring` of its own."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CHANNEL_BUFFER_BYTES)
        start = time.monotonic()
        try:
            fd = theirs.fileno()
            process = spawn_worker(fd) if self._reader is None else spawn_worker(fd, role="reader")
        except OSError as err:  # (EAGAIN, ENOMEM: maybe not next time) a death, backed off like any
            ours.close()
            log.error("worker %s generation %d could not be started: %s", self.name, generation, err)
            return WorkerDeath(generation, 0, -1, time.monotonic()), ""
        finally:
            theirs.close()
        self._process, refused, relay, up = process, "", None, False
        try:
            if process.stderr is not None:
                relay = OutputRelay(process.stderr, f"{self.name}-w{generation}")
            channel.send(ours, {"op": "map", "name": f"{self.name}-w{generation}", "poll_interval_s": self.poll_interval_s,
                                "regions": [{"file": f, "offset": o, "num_bytes": n} for f, o, n in self._regions],
                                **({"role": "reader", **self._reader} if self._reader is not None else {})},
                         self._files)
            self._until_mapped(ours, process, generation, start, self.poll_interval_s)
            up = True
            reasons = self._serve_until_replaced(ours, generation)
            self._retire(ours, process, relay, generation, reasons)
            return None, ""
        except channel.ChannelClosed:
            pass
        except Exception as err:  # noqa: BLE001 - out of protocol, never came up, or a callback failed
            message = getattr(err, "message", None) or f"{type(err).__name__}: {err}"
            log.error("worker %s generation %d: %s; killing it", self.name, generation, message)
            # Never up, for what it answered (it cannot map, or out of protocol): the next would do the same.
            refused = message if not up and not isinstance(err, MapTimedOut) else ""
            process.kill()
        noticed_s = time.monotonic()
        with self._send_lock:
            if self._serving is not None and self._serving[0] is ours:
                self._serving = None
        ours.close()
        try:
            returncode = process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # it closed its channel but lives on: ours to end
            process.kill()
            returncode = process.wait()
        if relay is not None:
            relay.join(1.0)  # its last lines (a crash's) before the death is logged
        elif process.stderr is not None:  # the relay could not start
            process.stderr.close()
        return WorkerDeath(generation, process.pid, returncode, noticed_s), refused

    def _ready(self, sock: socket.socket, timeout_s: float | None) -> bool:
        """Wait until ``sock`` has a message (True), the thread is woken, or ``timeout_s`` passed (False)."""
        ready = select.select([sock, self._wake_r], [], [], None if timeout_s is None else max(0.0, timeout_s))[0]
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)
        return sock in ready

    def _until_mapped(self, sock: socket.socket, process: subprocess.Popen, generation: int, start: float,
                      paced_s: float) -> None:
        deadline = start + MAP_TIMEOUT_S
        while True:
            ready = self._ready(sock, deadline - time.monotonic())
            if self._stopping.is_set():  # nothing was sent to it but its map: it goes now
                process.kill()
                raise channel.ChannelClosed("stopping")
            if not ready:
                if time.monotonic() >= deadline:
                    raise MapTimedOut("worker", f"no answer to map within {MAP_TIMEOUT_S:.0f} s")
                continue
            message, fds = channel.receive(sock)
            channel.close_all(fds)
            if message["op"] == "error":
                raise UnavailableError("worker", f"it could not map: {str(message.get('message'))[:500]}")
            if message["op"] != "mapped":
                raise InvalidArgumentError("message", f"{message['op'][:32]!r} before mapped")
            up = self._checked_up(message, generation, process.pid, start)
            self._publish(sock, process, up, paced_s)
            if not up.sandbox.startswith("landlock"):
                log.warning("worker %s runs unconfined (%s): code running in it can open the daemon's files",
                            self.name, up.sandbox)
            if generation > 1:
                log.warning("worker %s generation %d (pid %d) is up after %.2f s", self.name, generation,
                            process.pid, up.start_s)
            return

    def _publish(self, sock: socket.socket, process: subprocess.Popen, up: WorkerUp, paced_s: float) -> None:
        """Make ``up`` the serving generation. Nothing was sent to it but its map: on_up's sends (what the
        last generation had loaded) are the first, and no other thread's send overtakes them."""
        with self.up_lock:
            with self._send_lock:
                self._serving, self._full_since_s = (sock, process), None
                self._serving_generation = up.generation
            with self._changed:
                self._replace_reasons.clear()  # asked for before it was up: it is new
            if self._on_up is not None:
                self._on_up(up)
            if self.poll_interval_s != paced_s:  # paced while it started
                self.send({"op": "pace", "poll_interval_s": self.poll_interval_s})
            with self._changed:
                self._current = up
                self._changed.notify_all()
        for retiring in list(self._retiring):
            retiring.successor_up.set()

    def _serve_until_replaced(self, sock: socket.socket, generation: int) -> tuple[str, ...]:
        """Take what the serving generation sends until a replacement is due (its reasons) or it ends
        (:class:`channel.ChannelClosed`)."""
        stop_sent = False
        while True:
            if self._stopping.is_set() and not stop_sent:  # stop() may have sent before it was published
                stop_sent = True
                with contextlib.suppress(BlockingIOError, channel.ChannelClosed, OSError):
                    channel.send(sock, {"op": "stop"}, block=False)
            wait_s = None
            with self._changed:
                if self._replace_reasons and not self._stopping.is_set():
                    wait_s = self._last_replace_s + self.min_replace_interval_s - time.monotonic()
                    if wait_s <= 0:
                        reasons = tuple(self._replace_reasons)
                        self._replace_reasons.clear()
                        return reasons
            if self._ready(sock, wait_s):
                message, fds = channel.receive(sock)
                channel.close_all(fds)  # a worker never hands fds back
                self._take(message, generation)

    def _retire(self, sock: socket.socket, process: subprocess.Popen, relay, generation: int,
                reasons: tuple[str, ...]) -> None:
        """Hand the serving generation to a thread of its own until its successor is up (and a grace)."""
        self._last_replace_s = time.monotonic()
        retiring = Retiring(self.name, generation, sock, process, relay, reasons,
                            take=lambda message: self._take(message, generation), successor_up=threading.Event(),
                            stopping=self._stopping, grace_s=self.retire_grace_s,
                            max_wait_s=MAP_TIMEOUT_S + self.retire_grace_s, on_end=self._retired)
        self._retiring.append(retiring)
        retiring.start()
        log.warning("worker %s generation %d (pid %d) is replaced (%s); it serves until %.0f s after its "
                    "successor is up", self.name, generation, process.pid, ", ".join(reasons), self.retire_grace_s)
        if self._on_replace is not None:
            try:
                self._on_replace(reasons)
            except Exception:  # noqa: BLE001 - a counter; the old generation is the Retiring's now, whatever
                log.exception("worker %s: on_replace failed", self.name)

    def _retired(self, retiring: Retiring, stop_sent: bool, returncode: int) -> None:
        """A replaced generation is gone (its thread): stopped as asked, or it died before."""
        with contextlib.suppress(ValueError):
            self._retiring.remove(retiring)
        if stop_sent:
            self.replaced.append(WorkerReplaced(retiring.generation, retiring.process.pid, retiring.reasons,
                                                time.monotonic()))
            # Its successor never came up in time (MAP_TIMEOUT_S): the rank has no worker until one does.
            self._gone(retiring.generation, retiring.process.pid)
            log.info("worker %s generation %d (pid %d) retired", self.name, retiring.generation, retiring.process.pid)
            if self._on_retired is not None:
                self._on_retired(retiring.generation)
        else:
            log.warning("worker %s generation %d (pid %d, replaced) ended with %d before its stop", self.name,
                        retiring.generation, retiring.process.pid, returncode)
            self._died(WorkerDeath(retiring.generation, retiring.process.pid, returncode, time.monotonic()))

    def _checked_up(self, message: dict, generation: int, pid: int, start: float) -> WorkerUp:
        """The ``mapped`` answer, believed only as far as it can be checked: the agents it was told to make
        (a worker naming another's agent would have peers refuse that one), one address per region."""
        addresses, name = message.get("addresses"), f"{self.name}-w{generation}"
        if not (isinstance(addresses, list) and len(addresses) == len(self._regions)
                and all(isinstance(a, int) and 0 < a < 1 << 64 for a in addresses)):
            raise InvalidArgumentError("mapped", "one address (a u64) per region")
        try:
            metadata = bytes.fromhex(str(message.get("metadata")))
            notices = bytes.fromhex(str(message.get("notices_metadata"))) if self._reader is None else b""
        except ValueError:
            raise InvalidArgumentError("mapped", "metadata that is not hex") from None
        if agent_name_of(metadata) != name or (self._reader is None and agent_name_of(notices) != f"{name}.notices"):
            raise InvalidArgumentError("mapped", f"agents not named {name!r} and {name + '.notices'!r}")
        return WorkerUp(generation, pid, metadata, tuple(addresses), time.monotonic() - start, notices,
                        str(message.get("sandbox"))[:200])

    def _take(self, message: dict, generation: int) -> None:
        op = message["op"]
        if self._reader is not None and (op in READER_ANSWERS or op in SESSION_EVENTS or op == "error" and "id" in message):
            if self._on_answer is not None:
                self._on_answer(generation, message)
        elif op == "notices":
            pairs = channel.notices_of(message)
            if self._on_notices is not None:
                self._on_notices(generation, pairs)
        elif op in ("error", "pong"):
            log.warning("worker %s: %s %s", self.name, op, str(message.get("message", ""))[:500])
        else:
            raise InvalidArgumentError("message", f"unexpected op {op[:32]!r} from a worker")
