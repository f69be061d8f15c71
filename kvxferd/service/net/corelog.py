"""gRPC core's own log lines, read back: a refused TLS handshake becomes an audit line.

A peer refused in the TLS handshake (no client certificate, one of another
CA, an expired one, plaintext on a TLS port) never reaches a call, so
Python sees nothing of it. gRPC's C core does: it writes one line per
failed handshake to file descriptor 2 (its log, not Python's)::

    I1128 22:34:09.374385 7865 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL:
      error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: ...

unformatted, without the peer's address, and one per attempt: a flood of
bad handshakes was a flood of lines. :func:`route_core_log` puts a pipe
under fd 2 before any server starts: Python's own writes (the log handler,
``sys.stderr``) go to the original stderr directly; a small child process
(this module's ``main``) reads the pipe, turns each failed handshake into
:func:`kvxferd.service.base.audit.tls_refused` (rate-limited per reason, like
every refusal) and passes every other line through unchanged::

    daemon: gRPC, UCX, C libraries ──fd 2──► pipe ──► child: handshake lines -> audit lines ──► stderr
            Python's log handler ─────────────────────────────────────────────────────────────► stderr

A child, not a thread: what a dying daemon writes last (UCX's ``Fatal``
before its abort, a fatal ``CHECK`` of gRPC's) is still in the pipe when
it dies; the child reads it to the end and exits at EOF. The pipe's write
end never blocks: if the child falls behind, lines are dropped, never the
daemon's threads stalled. What it cannot say is who: gRPC's line has no
address (``GRPC_TRACE=handshaker`` has it, at several kilobytes per
handshake).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import re
import subprocess
import sys

from kvxferd.service.base import audit

PIPE_BYTES = 1 << 20  # room for a burst of lines before any is dropped
F_SETPIPE_SZ = 1031
HANDSHAKE_FAILED = re.compile(rb"\] Handshake failed with (?:fatal )?error ([A-Z_]+)(.*)")
OPENSSL_REASON = re.compile(rb"OPENSSL_internal:([A-Z0-9_]+)")
MAX_LINE_BYTES = 16384

_routed = False


def handshake_refusal(line: bytes) -> str | None:
    """The reason of a failed handshake in one line of gRPC's log (``PEER_DID_NOT_RETURN_A_CERTIFICATE``,
    ``WRONG_VERSION_NUMBER``, ...), else None."""
    match = HANDSHAKE_FAILED.search(line)
    if match is None:
        return None
    reason = OPENSSL_REASON.search(match.group(2))
    return (reason.group(1) if reason else match.group(1)).decode("ascii", "replace")


def route_core_log(log_level: str, log_format: str, window_s: float, lines_per_window: int) -> None:
    """Have a child read gRPC core's fd-2 lines (once per process; where fd 2 cannot be rerouted or the
    child does not start, nothing changes and handshake refusals stay unlogged). The arguments configure
    the child's logging and audit limits as the daemon's."""
    global _routed
    if _routed:
        return
    try:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, F_SETPIPE_SZ, PIPE_BYTES)
    try:
        subprocess.Popen([sys.executable, "-m", "kvxferd.service.net.corelog", log_level, log_format, str(window_s),
                          str(lines_per_window)], stdin=read_fd, stdout=2, stderr=2, close_fds=True,
                         start_new_session=True)  # a SIGINT to the daemon's group is the daemon's to handle
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return
    os.close(read_fd)
    original = os.dup(2)
    stream = io.TextIOWrapper(io.FileIO(original, "w"), line_buffering=True, errors="backslashreplace")
    for handler in logging.getLogger("kvxferd").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
            handler.setStream(stream)
    sys.stderr = stream
    os.dup2(write_fd, 2)  # from here gRPC's (and any C library's) stderr goes through the pipe
    os.close(write_fd)
    fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)  # a full pipe drops, never blocks
    _routed = True


def pump(read_fd: int, original: int) -> None:
    """Pass lines from ``read_fd`` to ``original``, failed handshakes as audit lines, until EOF."""
    pending = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        if len(pending) > MAX_LINE_BYTES:  # no line end in sight: pass it on as it is
            lines.append(pending)
            pending = b""
        for line in lines:
            _one_line(line, original)
    if pending:
        _one_line(pending, original)
    audit.flush()


def _one_line(line: bytes, original: int) -> None:
    try:
        reason = handshake_refusal(line)
        if reason is not None:
            audit.tls_refused(reason)
            return
    except Exception:  # never lose gRPC's line for a fault of ours
        pass
    with contextlib.suppress(OSError):
        os.write(original, line + b"\n")


def main(argv: list[str]) -> None:
    """The child: ``LEVEL FORMAT WINDOW_S LINES_PER_WINDOW``; reads stdin to EOF (the daemon and every
    process that inherited its stderr gone)."""
    import signal

    from kvxferd.service.base.logs import setup_logging
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the daemon's end is our EOF, not a signal
    level, fmt, window_s, lines_per_window = argv
    setup_logging(level, fmt)
    audit.configure(float(window_s), int(lines_per_window))
    pump(0, 1)


if __name__ == "__main__":
    main(sys.argv[1:])
