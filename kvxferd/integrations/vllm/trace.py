"""Per-request timestamps of a P/D request in every process it crosses (issue #41), off by default.

With ``KVXFERD_TRACE_DIR`` set (or ``kv_connector_extra_config.trace_dir``),
each process that stamps (the proxy, each engine's scheduler and workers)
appends JSON lines to ``<dir>/<who>-<pid>.jsonl``::

    {"t": 1795000000.123456, "who": "decode-worker0", "event": "submitted", "id": "cmpl-..-0"}

``t`` is ``time.time()``: on one host every process reads the same clock, so
stamps of the proxy, both engines and the client line up. A decode request
has its own id in vLLM; its ``matched`` stamp names the prefill's id
(``remote``), which joins the two engines, and the proxy stamps with the
prefill's id. ``kvxferd/rig/vllm/tracejoin.py`` turns the files into the
per-segment table of docs/benchmarks.md.

Off, a stamp is one attribute test; on, one short write per event (a
benchmark's tool, not for production traffic).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

TRACE_DIR_ENV = "KVXFERD_TRACE_DIR"


class Trace:
    """Where one process writes its stamps; disabled when no folder is named."""

    def __init__(self, who: str, folder: str | None = None) -> None:
        folder = folder or os.environ.get(TRACE_DIR_ENV) or None
        self.who = who
        self._file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            self._file = open(os.path.join(folder, f"{who}-{os.getpid()}.jsonl"), "a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def stamp(self, event: str, request_ids: Iterable[str], at_s: float | None = None, **fields) -> None:
        """One line per request id: ``event`` happened at ``at_s`` (default: now, ``time.time()``)."""
        if self._file is None:
            return
        at_s = time.time() if at_s is None else at_s
        lines = [json.dumps({"t": at_s, "who": self.who, "event": event, "id": request_id, **fields})
                 for request_id in request_ids]
        if lines:
            self._file.write("\n".join(lines) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_stamps(folder: str) -> list[dict]:
    """Every stamp under ``folder`` (a torn last line of a killed process is skipped)."""
    stamps: list[dict] = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(folder, name)) as lines:
            for line in lines:
                try:
                    stamps.append(json.loads(line))
                except ValueError:
                    continue
    return stamps
