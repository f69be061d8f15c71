"""Structured logs: one JSON object per line on stderr (or plain text).

Fields passed with ``extra={...}`` become keys of the object, so a log
pipeline can filter on ``engine_id`` or ``remote_engine_id`` directly.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        line = f"{self.formatTime(record)} {record.levelname:7s} {record.name}: {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


def setup_logging(level: str, fmt: str) -> None:
    """Configure the ``kvxferd`` logger tree (stderr; stdout stays for the ready line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("kvxferd")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
