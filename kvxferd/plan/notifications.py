"""The notification a reader sends every remote rank holding a request's data.

Sent over NIXL from the reader's notice agent (a second agent, so that its
data READs never queue behind a notification: docs/benchmarks.md), after the
read ended and the holder's board was checked. A notice names the
prefill-side request, the reader, whether the read succeeded, and how many
readers the prefill rank must hear from before it may free the request's
blocks. Nothing answers it: whether the hold was alive is what the reader
learned from the board (:mod:`kvxferd.plan.board`). It also says whether the
reader needed the holder's progress: over shared memory on one host UCX
copies inside the READ's post (``process_vm_readv``) and the holder may poll
slowly; over TCP a READ waits for the holder's next poll.

A small fixed binary record (encoding one is ~1 µs, a JSON object was ~5 µs
each way), validated field by field on decode: it comes from peers::

    offset  size  field
         0     2  magic           b"KN"
         2     1  version         1
         3     1  flags           bit 0: ok; bit 1: alone (every READ of this
                                  holder's memory, data and board check, ended
                                  within its post: no progress of the holder's)
         4     2  reader_rank     little-endian u16
         6     2  expected        u16: readers to expect, >= 1
         8     2  len(request_id)         u16, 1..MAX_ID_BYTES
        10     2  len(reader_engine_id)   u16, 1..MAX_ID_BYTES
        12    16  capability      the hold's (:mod:`kvxferd.plan.capability`): a notice
                                  ends only a hold its sender was given
        28     .  request_id, reader_engine_id (UTF-8), nothing after

A reader also sends each holder one ``HELLO`` (3 bytes) when it connects:
UCX picks its protocol for a new connection's first notification, which
took about 1 ms here, and that would otherwise be the first request's.
A holder ignores a hello (it says nothing and ends nothing).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.capability import CAPABILITY_BYTES

RECORD_VERSION = 2  # 2: the hold's capability
MAX_ID_BYTES = 512
_HEADER = struct.Struct(f"<2sBBHHHH{CAPABILITY_BYTES}s")
_NOTICE = b"KN"
_OK, _ALONE = 1, 2  # flag bits
HELLO = b"KH\x01"  # sent once per connection; ignored by the holder


def _decode(message: bytes, field: str = "notification") -> tuple[int, int, int, bytes, str, str]:
    """(flags, reader_rank, expected, capability, request_id, reader_engine_id) of a peer's record, every
    field checked."""
    if not isinstance(message, (bytes, bytearray)) or len(message) < _HEADER.size:
        raise InvalidArgumentError(field, f"not a kvxferd {field}: {len(message or b'')} bytes")
    got_magic, version, flags, reader_rank, expected, rid_len, eid_len, capability = _HEADER.unpack_from(message)
    if got_magic != _NOTICE:
        raise InvalidArgumentError(field, f"not a kvxferd {field}: starts with {bytes(message[:2])!r}")
    if version != RECORD_VERSION:
        raise InvalidArgumentError(f"{field}.version", f"unsupported {field} version {version}")
    if flags & ~(_OK | _ALONE):
        raise InvalidArgumentError(f"{field}.flags", f"unknown flags {flags:#x}")
    if not (0 < rid_len <= MAX_ID_BYTES and 0 < eid_len <= MAX_ID_BYTES):
        raise InvalidArgumentError(field, f"id lengths {rid_len}, {eid_len} outside [1, {MAX_ID_BYTES}]")
    if len(message) != _HEADER.size + rid_len + eid_len:
        raise InvalidArgumentError(field, f"{len(message)} bytes, the header announces {_HEADER.size + rid_len + eid_len}")
    try:
        request_id = bytes(message[_HEADER.size:_HEADER.size + rid_len]).decode()
        reader_engine_id = bytes(message[_HEADER.size + rid_len:]).decode()
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(field, f"ids are not UTF-8: {err}") from None
    return flags, reader_rank, expected, capability, request_id, reader_engine_id


@dataclass(frozen=True)
class ReadNotice:
    """Reader ``reader_engine_id``/``reader_rank`` is done with ``request_id``."""

    request_id: str  # the prefill side's request id
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    ok: bool = True
    alone: bool = False  # the reader's READs of this holder ended within their posts (no progress needed)
    capability: bytes = bytes(CAPABILITY_BYTES)  # of the hold on the receiving rank

    def encode(self) -> bytes:
        rid, eid = self.request_id.encode(), self.reader_engine_id.encode()
        flags = (_OK if self.ok else 0) | (_ALONE if self.alone else 0)
        return _HEADER.pack(_NOTICE, RECORD_VERSION, flags, self.reader_rank, self.expected_readers,
                            len(rid), len(eid), self.capability) + rid + eid

    @classmethod
    def decode(cls, message: bytes) -> "ReadNotice":
        """Parse a peer's message; raises :class:`InvalidArgumentError` naming the field."""
        flags, reader_rank, expected, capability, request_id, reader_engine_id = _decode(message)
        if expected < 1:
            raise InvalidArgumentError("notification.expected_readers", "a notice must expect at least one reader")
        return cls(request_id, reader_engine_id, reader_rank, expected, bool(flags & _OK), bool(flags & _ALONE),
                   capability)
