"""The transport self-check: which path UCX took for this daemon's READs, said in a metric and a log line.

UCX reports each protocol selection into a log file per process (the daemon's
and its data-plane workers': :func:`kvxferd.xfer.nixl.ucxpaths.log_environment`,
set before the first agent). The daemon reads what is new at each
maintenance tick and after each handshake (whose probe is the link's first
READ), and:

* sets ``kvxferd_transport_paths{memory, path}`` to the number of UCX endpoint
  configurations whose bulk READs take that path (``emulated``: UCX moves the
  READ with messages over a copy lane, e.g. TCP: the silent slow fallback);
* logs each new selection once, with every size range and lane, at INFO for
  a fast path and WARNING for TCP or emulation;
* relays UCX's own warnings and errors, which now go to that file, to the
  daemon's log.

The files live in a private directory removed at shutdown. Without the
check (``transport_check: false``, or an operator's own ``UCX_PROTO_INFO=n``),
the metric stays at zero and :meth:`TransportPaths.describe` says the path is
not known.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from collections import Counter

from kvxferd.xfer.nixl.ucxpaths import (FAST_PATHS, MEMORY_PAIRS, PATHS, ReadPath, UcxLog, flush_c_streams,
                                        log_environment)

log = logging.getLogger(__name__)
MAX_RELAYED_LINES = 20  # UCX warnings and errors copied to the daemon's log per refresh
DIRECTORY_PREFIX = "kvxferd-ucx-"
LOCK_NAME = "daemon.lock"


class TransportPaths:
    """Reads UCX's selection reports for one daemon (its own process and its workers')."""

    def __init__(self, gauge=None) -> None:
        self.gauge = gauge  # kvxferd_transport_paths, labelled (memory, path)
        self.directory = ""
        self.ucx_log: UcxLog | None = None
        self.enabled = False
        self._lock_fd = -1

    def environment(self, environ=os.environ) -> dict[str, str]:
        """Make the private directory; the UCX variables to set before the first agent (empty: not enabled)."""
        if environ.get("UCX_PROTO_INFO", "").lower() in ("n", "no", "0", "off"):
            log.warning("transport self-check off: UCX_PROTO_INFO=n is set; the daemon cannot tell which path "
                        "UCX takes")
            return {}
        remove_stale_directories()
        try:
            self._make_directory()
        except OSError as err:  # a read-only or full temporary directory: the daemon runs without the check
            log.warning("transport self-check off: cannot make its directory in %s: %s", tempfile.gettempdir(),
                        err.strerror or err)
            return {}
        wanted = log_environment(self.directory, environ)
        self.ucx_log = UcxLog(environ.get("UCX_LOG_FILE") or wanted["UCX_LOG_FILE"])
        self.enabled = True
        return wanted

    def _make_directory(self) -> None:
        """Made under another name, locked, then renamed: a directory under the prefix has its lock held from
        the start, and another daemon's clean-up (any PID namespace, a shared /tmp) leaves it alone while
        this one lives."""
        staging = tempfile.mkdtemp(prefix=f".{DIRECTORY_PREFIX}{os.getpid()}-")  # 0700: this daemon's alone
        try:
            self._lock_fd = os.open(os.path.join(staging, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self.directory = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
            os.rename(staging, self.directory)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def refresh(self, context: str = "") -> list[ReadPath]:
        """Read what UCX reported since last time; log and count new selections (``context``: what caused them)."""
        if self.ucx_log is None:
            return []
        flush_c_streams()
        new, messages = self.ucx_log.read()
        forgot = self.ucx_log.forget_exited()  # after: what a replaced worker chose before it went is said once
        for pid, level, text in messages[:MAX_RELAYED_LINES]:
            log.log(logging.ERROR if level == "ERROR" else logging.WARNING, "UCX: %s", text, extra={"pid": pid})
        if len(messages) > MAX_RELAYED_LINES:  # a flood (a peer can provoke UCX's warnings) is counted, not copied
            log.warning("UCX: %d more warnings and errors not relayed (see %s)", len(messages) - MAX_RELAYED_LINES,
                        self.directory)
        for pid, selection in new:
            slow = selection.path not in FAST_PATHS
            log.log(logging.WARNING if slow else logging.INFO, "transport path: READ %s takes %s%s",
                    selection.memory, selection.path, " (slow: UCX found no direct lane)" if slow else "",
                    extra={"pid": pid, "ucx": selection.describe(), "locality": selection.locality,
                           **({"after": context} if context else {})})
        if self.gauge is not None and (new or forgot):
            self._count()
        return [selection for _pid, selection in new]

    def _count(self) -> None:
        """Every series set anew: a selection that changed path, or whose process exited, leaves none behind."""
        counts = Counter((s.memory, s.path) for s in self.ucx_log.selections.values() if s.locality != "self")
        for memory in MEMORY_PAIRS:
            for path in PATHS:
                self.gauge.labels(memory, path).set(counts.pop((memory, path), 0))
        for (memory, path), count in counts.items():  # a memory type outside the pairs above
            self.gauge.labels(memory, path).set(count)

    def describe(self, agent: str | None = None) -> str:
        """Every READ path so far, one per memory pair and locality (of ``agent``'s UCX workers only: UCX
        names a worker by its agent, cut at 31 bytes, or a worker's agent by the slot's name and more)."""
        if not self.enabled:
            return "unknown (transport self-check off)"
        seen = sorted({(s.memory, s.locality, s.path) for s in self.ucx_log.selections.values()
                       if s.locality != "self" and (agent is None or s.worker == agent[:len(s.worker)]
                                                    or s.worker.startswith(agent))})
        return ", ".join(f"{memory} {locality}: {path}" for memory, locality, path in seen) or "no READ yet"

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""


def remove_stale_directories(parent: str | None = None) -> None:
    """Remove the UCX log directories of daemons of this user that died without removing theirs (SIGKILL):
    those whose lock no process holds (a live daemon holds its own, whatever its PID namespace). A UCX crash
    report in one is copied to this log first (the lines of a fatal signal are ERRORs)."""
    parent = parent or tempfile.gettempdir()
    try:
        entries = [e for e in os.listdir(parent) if e.startswith(DIRECTORY_PREFIX)]
    except OSError:
        return
    for entry in entries:
        path = os.path.join(parent, entry)
        try:
            status = os.lstat(path)
            if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
                continue
            lock = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its daemon lives
        finally:
            os.close(lock)
        messages = UcxLog(os.path.join(path, "ucx.%p.log")).read()[1]
        for file_pid, level, text in [m for m in messages if m[1] == "ERROR"][:MAX_RELAYED_LINES]:
            log.warning("UCX of a daemon that died (pid %d): %s", file_pid, text)
        shutil.rmtree(path, ignore_errors=True)


def host_rdma(sysfs: str = "/sys") -> tuple[list[str], bool]:
    """This host's RDMA devices (``/sys/class/infiniband``) and whether nvidia-peermem is loaded (a NIC can then
    register GPU memory by its address; without it only DMA-BUF can: docs/gpu.md)."""
    try:
        devices = sorted(os.listdir(os.path.join(sysfs, "class", "infiniband")))
    except OSError:
        devices = []
    return devices, os.path.isdir(os.path.join(sysfs, "module", "nvidia_peermem"))


def rdma_refusal(require_rdma_vram: bool, sysfs: str = "/sys") -> str | None:
    """Start-up: with ``require_rdma_capable_vram``, a host without an RDMA device is a reason not to start
    (its VRAM would be read from other hosts by emulation over TCP); else None. Says what it found either way."""
    devices, peermem = host_rdma(sysfs)
    log.info("GPU transport: RDMA devices %s, nvidia-peermem %s", devices or "none",
             "loaded" if peermem else "not loaded (a NIC registers GPU memory only by DMA-BUF)")
    if require_rdma_vram and not devices:
        return ("require_rdma_capable_vram is set but this host has no RDMA device (/sys/class/infiniband is empty): "
                "GPU caches would be read from other hosts by UCX's emulation over TCP (docs/gpu.md)")
    return None
