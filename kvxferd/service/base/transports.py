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

import logging
import os
import shutil
import tempfile
from collections import Counter

from kvxferd.xfer.nixl.ucxpaths import FAST_PATHS, ReadPath, UcxLog, flush_c_streams, log_environment

log = logging.getLogger(__name__)


class TransportPaths:
    """Reads UCX's selection reports for one daemon (its own process and its workers')."""

    def __init__(self, gauge=None) -> None:
        self.gauge = gauge  # kvxferd_transport_paths, labelled (memory, path)
        self.directory = ""
        self.ucx_log: UcxLog | None = None
        self.enabled = False

    def environment(self, environ=os.environ) -> dict[str, str]:
        """Make the private directory; the UCX variables to set before the first agent (empty: not enabled)."""
        if environ.get("UCX_PROTO_INFO", "").lower() in ("n", "no", "0", "off"):
            log.warning("transport self-check off: UCX_PROTO_INFO=n is set; the daemon cannot tell which path "
                        "UCX takes")
            return {}
        self.directory = tempfile.mkdtemp(prefix="kvxferd-ucx-")  # 0700: UCX's log of this daemon alone
        wanted = log_environment(self.directory, environ)
        self.ucx_log = UcxLog(environ.get("UCX_LOG_FILE") or wanted["UCX_LOG_FILE"])
        self.enabled = True
        return wanted

    def refresh(self, context: str = "") -> list[ReadPath]:
        """Read what UCX reported since last time; log and count new selections (``context``: what caused them)."""
        if self.ucx_log is None:
            return []
        flush_c_streams()
        new, messages = self.ucx_log.read()
        for pid, level, text in messages:
            log.log(logging.ERROR if level == "ERROR" else logging.WARNING, "UCX: %s", text, extra={"pid": pid})
        for pid, selection in new:
            slow = selection.path not in FAST_PATHS
            log.log(logging.WARNING if slow else logging.INFO, "transport path: READ %s takes %s%s",
                    selection.memory, selection.path, " (slow: UCX found no direct lane)" if slow else "",
                    extra={"pid": pid, "ucx": selection.describe(), "locality": selection.locality,
                           **({"after": context} if context else {})})
        if new and self.gauge is not None:
            self._count()
        return [selection for _pid, selection in new]

    def _count(self) -> None:
        counts = Counter((s.memory, s.path) for s in self.ucx_log.selections.values() if s.locality != "self")
        for (memory, path), count in counts.items():
            self.gauge.labels(memory, path).set(count)

    def paths(self, memory: str = "host<-host", locality: str | None = None) -> list[str]:
        """The bulk paths UCX chose for READs of ``memory`` so far (sorted, each once)."""
        if self.ucx_log is None:
            return []
        return sorted({s.path for s in self.ucx_log.selections.values()
                       if s.memory == memory and s.locality != "self" and locality in (None, s.locality)})

    def describe(self) -> str:
        """Every READ path so far, one per memory pair and locality: for a person (``kvxferd bench``)."""
        if not self.enabled:
            return "unknown (transport self-check off)"
        seen = sorted({(s.memory, s.locality, s.path) for s in self.ucx_log.selections.values()
                       if s.locality != "self"})
        return ", ".join(f"{memory} {locality}: {path}" for memory, locality, path in seen) or "no READ yet"

    def close(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""
