"""The audit log: one ``kvxferd.audit`` line per security decision, refusals rate-limited per caller.

What gets a line::

    peer port      every introduction (GetEngineInfo) and renewal, every refusal   peer_call
    engine socket  UNAUTHENTICATED / PERMISSION_DENIED (a session or token, a shm engine_call
                   object the engine may not name)
    reads socket   a uid refused (SO_PEERCRED), a session refused                  socket_refused
    fd socket      a uid refused (SO_PEERCRED)                                     socket_refused
    reads          a read whose capabilities do not seal its hold (forged, guessed) capability_refused
    readers        a reader's agent replaced by a new introduction                 reader_replaced
    TLS            a handshake refused (no, an expired or a foreign certificate)   tls_refused

Refusals cost the caller nothing, so a flooder could write the log at
disk speed (1.35 MB/s from one local uid before). Each refusal is counted
under its *caller* (the peer's host and identity, the uid on a UNIX socket,
the engine for capabilities) and its outcome: the first
``audit_lines_per_window`` of a window are written, the rest counted, and
when the window ends one line says ``N more refusals from X in T s``. At
most :data:`MAX_CALLERS` callers are tracked (more fall under one
``others`` caller) and at most :data:`MAX_LINES_PER_WINDOW` lines are
written per window for all callers together, so the log's rate is bounded
whatever the callers do. Admitted decisions (an introduction, a renewal)
are written as they come: only allowed peers make them.

Every field is the caller's own text, so the formatters escape it
(:mod:`kvxferd.service.base.logs`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from kvxferd.service.base.identities import peer_identities

audit_log = logging.getLogger("kvxferd.audit")

WINDOW_S = 10.0
LINES_PER_WINDOW = 5  # per caller and outcome
MAX_CALLERS = 256  # callers (with outcome) tracked at once; more are one "others" caller
MAX_LINES_PER_WINDOW = 50  # refusal lines of all callers together, per window
MAX_SUMMARIES = 16  # summary lines per flush; the rest are merged into one
MAX_FIELD_CHARS = 300
OTHERS = ("others",)
# Engine-side codes that say someone tried what it may not; the rest are the engine's own mistakes.
SECURITY_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


@dataclass
class _Window:
    start: float
    event: str
    caller: str
    outcome: str
    lines: int = 0
    suppressed: int = 0
    last: dict = field(default_factory=dict)  # the last suppressed refusal's fields, for the summary


class RefusalLimiter:
    """Which refusals are written: per ``(caller, outcome)`` the first lines of each window; the rest are
    counted and summarised when the window ends. Thread-safe (the fd socket has its own thread)."""

    def __init__(self, window_s: float = WINDOW_S, lines_per_window: int = LINES_PER_WINDOW, *,
                 max_callers: int = MAX_CALLERS, max_lines: int = MAX_LINES_PER_WINDOW, clock=time.monotonic) -> None:
        self.window_s, self.lines_per_window = window_s, lines_per_window
        self.max_callers, self.max_lines = max_callers, max_lines
        self.clock = clock
        self._windows: OrderedDict[tuple, _Window] = OrderedDict()  # by window start, oldest first
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._global_start, self._global_lines = clock(), 0

    def admit(self, key: tuple, event: str, caller: str, outcome: str, fields: dict) -> bool:
        """Whether this refusal gets its own line now (else it is counted for its caller's summary)."""
        summaries = []
        with self._lock:
            now = self.clock()
            summaries = self._due(now)
            if now - self._global_start >= self.window_s:
                self._global_start, self._global_lines = now, 0
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= self.max_callers:
                    key, caller = OTHERS + (event, outcome), "others"  # bounded memory, whoever calls
                    window = self._windows.get(key)
                    if window is None and len(self._windows) >= self.max_callers:
                        summaries += self._pop_oldest()
                if window is None:
                    window = self._windows[key] = _Window(now, event, caller, outcome)
            admitted = window.lines < self.lines_per_window and self._global_lines < self.max_lines
            if admitted:
                window.lines += 1
                self._global_lines += 1
            else:
                window.suppressed += 1
                window.last = fields
                self._arm(now)
        _write_summaries(summaries, self.window_s)
        return admitted

    def flush(self, everything: bool = False) -> None:
        """Write the summaries of windows that ended (``everything``: of all windows, at exit)."""
        with self._lock:
            summaries = self._due(float("inf") if everything else self.clock())
        _write_summaries(summaries, self.window_s)

    def _due(self, now: float) -> list[_Window]:
        """Pop the windows that ended by ``now``; those that suppressed something need a summary."""
        ended = []
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if now - window.start < self.window_s:
                break
            del self._windows[key]
            if window.suppressed:
                ended.append(window)
        return ended

    def _pop_oldest(self) -> list[_Window]:
        _key, window = self._windows.popitem(last=False)
        return [window] if window.suppressed else []

    def _arm(self, now: float) -> None:
        """A summary is owed: make sure a timer writes it even if no refusal comes after the window."""
        if self._timer is not None:
            return
        first = next(iter(self._windows.values()))
        self._timer = threading.Timer(max(first.start + self.window_s - now, 0.0) + 0.01, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            summaries = self._due(self.clock())
            if any(w.suppressed for w in self._windows.values()):
                self._arm(self.clock())
        _write_summaries(summaries, self.window_s)


def _write_summaries(windows: list[_Window], window_s: float) -> None:
    for window in windows[:MAX_SUMMARIES]:
        audit_log.warning("%d more %s refusals from %s in %.0f s", window.suppressed, window.event, window.caller,
                          window_s, extra={**window.last, "event": window.event, "caller": window.caller,
                                           "outcome": window.outcome, "suppressed": window.suppressed,
                                           "window_s": window_s})
    rest = windows[MAX_SUMMARIES:]
    if rest:
        total = sum(w.suppressed for w in rest)
        audit_log.warning("%d more refusals from %d other callers in %.0f s", total, len(rest), window_s,
                          extra={"event": "refusals", "caller": "others", "suppressed": total,
                                 "callers": len(rest), "window_s": window_s})


_limiter = RefusalLimiter()
atexit.register(lambda: _limiter.flush(everything=True))  # before logging's own atexit: registered later


def configure(window_s: float, lines_per_window: int) -> None:
    """The daemon's ``audit_window_s`` and ``audit_lines_per_window`` (at start; a fresh limiter)."""
    global _limiter
    _limiter.flush(everything=True)
    _limiter = RefusalLimiter(window_s, lines_per_window)


def _refusal(event: str, caller: str, outcome: str, message: str, fields: dict) -> None:
    fields = {"event": event, "caller": caller, "outcome": outcome, **fields}
    if _limiter.admit((event, caller, outcome), event, caller, outcome, fields):
        audit_log.warning(message, extra=fields)


def _cut(text, limit: int = MAX_FIELD_CHARS) -> str:
    return str(text)[:limit]


def caller_host(peer: str) -> str:
    """A gRPC peer string without its port (``ipv4:10.0.0.7:53122`` -> ``ipv4:10.0.0.7``): a flooder's
    every connection has a new port, never a new address."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


def peer_call(method: str, request, context, code: grpc.StatusCode, error: str = "") -> None:
    """A decision on the peer port: who asked (certificate identities, address), of which engine, the outcome.
    A probe that is answered (GetIncarnation every ``peer_check_s`` per link, a Challenge) is not worth a line."""
    if code == grpc.StatusCode.OK and method in ("GetIncarnation", "Challenge"):
        return
    identity = _cut(",".join(peer_identities(context)))
    fields = {"method": method, "outcome": code.name, "peer": context.peer(), "identity": identity,
              "engine_id": _cut(getattr(request, "engine_id", ""), 256)}
    if method == "GetEngineInfo":
        fields["reader"] = f"{_cut(request.reader_engine_id, 256)}/{request.reader_tp_rank}"
    elif method == "RenewLeases":
        fields["num_request_ids"] = len(request.request_ids)
    if error:
        fields["error"] = _cut(error)
    if code == grpc.StatusCode.OK:
        audit_log.info("peer %s: %s", method, code.name, extra=fields)
        return
    caller = f"{caller_host(context.peer())} {identity}".strip()
    _refusal("peer", caller, code.name, f"peer {method}: {code.name}", fields)


def engine_call(method: str, request, context, code: grpc.StatusCode, error: str = "") -> None:
    """A call on the engine socket (or engine_tcp) refused for who made it: no or a wrong session or token,
    an object it may not have opened. Every other outcome is the engine's own business: no line."""
    if code not in SECURITY_CODES:
        return
    peer = context.peer() or "unix:"
    fields = {"method": method, "outcome": code.name, "peer": peer,
              "engine_id": _cut(getattr(request, "engine_id", ""), 256), "error": _cut(error)}
    _refusal("engine", caller_host(peer), code.name, f"engine {method}: {code.name}", fields)


def socket_refused(socket_name: str, uid: int, pid: int, code: grpc.StatusCode, error: str, engine_id: str = "") -> None:
    """The reads or fd socket refused a client: its uid (``SO_PEERCRED``) or, on the reads socket, its session."""
    fields = {"socket": socket_name, "outcome": code.name, "uid": uid, "pid": pid, "error": _cut(error)}
    if engine_id:
        fields["engine_id"] = _cut(engine_id, 256)
    _refusal(f"{socket_name} socket", f"uid {uid}", code.name, f"{socket_name} socket: {code.name}", fields)


def capability_refused(engine_id: str, remote_engine_id: str, request_id: str, error: str) -> None:
    """A read whose capabilities do not seal its remote hold: a bug, a replay of an older registration's, or
    a guess. Counted per reading engine, so brute force shows as a count, not a line per guess."""
    fields = {"engine_id": _cut(engine_id, 256), "remote_engine_id": _cut(remote_engine_id, 256),
              "request_id": _cut(request_id, 256), "outcome": "PERMISSION_DENIED", "error": _cut(error)}
    _refusal("capability", f"engine {_cut(engine_id, 256)}", "PERMISSION_DENIED", "read refused: capability", fields)


def reader_replaced(engine_id: str, reader: tuple[str, int], identity: str, old_agent: str, new_agent: str,
                    peer: str = "") -> None:
    """A reader introduced again under a new NIXL agent (a restarted reader, or someone taking its notices over):
    the holder's engine, the reader, the peer identity that did it, and both agents. Rate-limited like a
    refusal, per identity: an allowed peer replacing readers in a loop leaves a count."""
    fields = {"engine_id": _cut(engine_id, 256), "reader": f"{_cut(reader[0], 256)}/{reader[1]}",
              "identity": _cut(identity), "old_agent": _cut(old_agent, 256), "new_agent": _cut(new_agent, 256),
              "peer": peer, "outcome": "REPLACED"}
    _refusal("reader replacement", f"{caller_host(peer)} {identity}".strip(), "REPLACED",
             "peer GetEngineInfo: reader replaced", fields)


def tls_refused(reason: str, peer: str = "") -> None:
    """A TLS handshake on the peer port that failed (gRPC's core says so, not the call: no call was made)."""
    fields = {"outcome": "UNAUTHENTICATED", "reason": _cut(reason)}
    if peer:
        fields["peer"] = peer
    _refusal("tls handshake", peer or "unknown peers", "UNAUTHENTICATED", "TLS handshake refused", fields)


def flush() -> None:
    """Write the summaries owed now (tests, shutdown)."""
    _limiter.flush(everything=True)
