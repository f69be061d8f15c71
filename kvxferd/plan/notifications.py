"""The notification a reader sends every remote rank holding a request's data.

Sent over NIXL (attached to the transfer when the rank was read, standalone
otherwise). It names the prefill-side request, the reader, whether the read
succeeded, and how many readers the prefill rank must hear from before it
may free the request's blocks (every reader computes the same count from the
TP mapping). Decoding validates everything: notifications come from peers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvxferd.errors import InvalidArgumentError

NOTICE_VERSION = 1


@dataclass(frozen=True)
class ReadNotice:
    """Reader ``reader_engine_id``/``reader_rank`` is done with ``request_id``."""

    request_id: str  # the prefill side's request id
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    ok: bool = True

    def encode(self) -> bytes:
        return json.dumps({"v": NOTICE_VERSION, **asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, message: bytes) -> "ReadNotice":
        """Parse a peer's message; raises :class:`InvalidArgumentError` naming the field."""
        checks = {"request_id": str, "reader_engine_id": str, "reader_rank": int, "expected_readers": int, "ok": bool}
        data = _decode_fields(message, "v", NOTICE_VERSION, checks, "notification")
        if data["reader_rank"] < 0 or data["expected_readers"] < 1:
            raise InvalidArgumentError("notification", f"bad reader rank or count in {message[:80]!r}")
        return cls(**data)


def _decode_fields(message: bytes, marker: str, version: int, checks: dict, field: str) -> dict:
    """The JSON object of a peer's message, its version and field types checked."""
    try:
        data = json.loads(message)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidArgumentError(field, f"not a kvxferd {field}: {err}") from None
    if not isinstance(data, dict) or data.get(marker) != version:
        raise InvalidArgumentError(f"{field}.{marker}", f"unsupported {field} version in {message[:80]!r}")
    for name, kind in checks.items():
        value = data.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidArgumentError(f"{field}.{name}", f"expected {kind.__name__}, got {value!r}")
    return {name: data[name] for name in checks}

ACK_VERSION = 1


@dataclass(frozen=True)
class ReadAck:
    """The holder's answer to a reader's notice: was the hold alive when it came?

    A read is a success only if every rank it read from answers ``alive``:
    the notice follows the data, so an alive hold means the bytes were read
    while the blocks were still held (never freed and reused under the read).
    """

    request_id: str  # the prefill side's request id, as in the notice
    reader_engine_id: str
    reader_rank: int
    alive: bool

    def encode(self) -> bytes:
        return json.dumps({"ack": ACK_VERSION, **asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, message: bytes) -> "ReadAck":
        """Parse a holder's ack; raises :class:`InvalidArgumentError` naming the field."""
        checks = {"request_id": str, "reader_engine_id": str, "reader_rank": int, "alive": bool}
        return cls(**_decode_fields(message, "ack", ACK_VERSION, checks, "ack"))

def is_ack(message: bytes) -> bool:
    """Acks and notices share the NIXL channel; acks start with their own key."""
    return message.startswith(b'{"ack"')
