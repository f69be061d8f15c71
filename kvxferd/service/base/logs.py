"""Structured logs: one JSON object per line on stderr (or plain text).

Fields passed with ``extra={...}`` become keys of the object, so a log
pipeline can filter on ``engine_id`` or ``remote_engine_id`` directly.

Messages and fields carry callers' text (engine ids, request ids, errors
naming them), often before it is validated. JSON escapes every control
character by construction. The text format escapes them itself (``\\n``,
``\\x1b``, ...; a backslash as ``\\\\``), quotes a field value holding a space,
``=`` or ``"`` (``engine_id="a outcome=OK"``), and indents every line of a
traceback: a caller's text can neither start a line nor forge a field.
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


def escape_text(text: str) -> str:
    """``text`` with every character that is not printable (newlines, ESC, U+2028, ...) and the backslash
    written as a Python escape: one line, and nothing a terminal acts on."""
    if text.isprintable() and "\\" not in text:
        return text  # the common case, at C speed
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)


def _field_value(value) -> str:
    text = escape_text(str(value))
    if not text or any(c in text for c in ' ="'):
        return '"' + text.replace('"', '\\"') + '"'
    return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{escape_text(k)}={_field_value(v)}" for k, v in vars(record).items() if k not in _STANDARD)
        line = f"{self.formatTime(record)} {record.levelname:7s} {record.name}: {escape_text(record.getMessage())}"
        line = f"{line} {extra}" if extra else line
        if not record.exc_info:
            return line
        trace = self.formatException(record.exc_info).splitlines()  # splits at every line break a caller could hide
        return "\n".join([line, *(f"    | {escape_text(part)}" for part in trace)])


def setup_logging(level: str, fmt: str) -> None:
    """Configure the ``kvxferd`` logger tree (stderr; stdout stays for the ready line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("kvxferd")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
