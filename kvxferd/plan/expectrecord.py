"""The expectation a decode rank sends each prefill rank that writes into it (push, issue #57).

Sent over NIXL from the decode rank's notice agent to the prefill rank's
agent, the way read notices go the other way: no gRPC call on a push's
path. The prefill daemon counts it only from the agent an authenticated
peer introduced for that decode rank (its handshake), and writes only once
its own engine holds the transfer. A fixed binary record, validated field
by field on decode (it comes from a peer)::

    offset  size  field
         0     2  magic            b"KE"
         2     1  version          1
         3     1  num_groups       1..MAX_GROUPS
         4     2  reader_rank      u16: the decode rank
         6     2  len(transfer_id)         u16, 1..MAX_ID_BYTES
         8     2  len(reader_engine_id)    u16, 1..MAX_ID_BYTES
        10     4  num_tokens       u32 (0: unknown)
        14     4  deadline_ms      u32 (relative; >= 1): no write is posted after it
        18    16  capability       the expectation's, minted by the decode rank
        34    16  push_key         the transfer's (kvxferd.plan.capability): opens the prefill hold
        50   4*G  ids per group    u32 each; their sum <= MAX_IDS
         .     .  transfer_id, reader_engine_id (UTF-8), then the ids (i32, >= 0), nothing after
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.capability import CAPABILITY_BYTES, PUSH_KEY_BYTES
from kvxferd.plan.notifications import MAX_ID_BYTES

MAGIC = b"KE"
VERSION = 2  # 2: the push key
MAX_GROUPS = 16
MAX_IDS = 1 << 20  # block ids of one expectation, every group together (4 MiB)
_HEADER = struct.Struct(f"<2sBBHHHII{CAPABILITY_BYTES}s{PUSH_KEY_BYTES}s")
FIELD = "expectation"


@dataclass(frozen=True, eq=False)
class ExpectRecord:
    """Decode rank ``reader_engine_id``/``reader_rank`` expects ``transfer_id`` in ``block_ids``."""

    transfer_id: str
    reader_engine_id: str
    reader_rank: int
    block_ids: tuple[np.ndarray, ...]  # per group, the decode blocks to write
    capability: bytes
    deadline_s: float
    push_key: bytes
    num_tokens: int | None = None

    def encode(self) -> bytes:
        tid, eid = self.transfer_id.encode(), self.reader_engine_id.encode()
        counts = [len(ids) for ids in self.block_ids]
        header = _HEADER.pack(MAGIC, VERSION, len(counts), self.reader_rank, len(tid), len(eid), self.num_tokens or 0,
                              max(1, round(self.deadline_s * 1e3)), self.capability, self.push_key)
        ids = np.concatenate([np.asarray(i, dtype="<i4") for i in self.block_ids]) if counts else np.zeros(0, "<i4")
        return header + struct.pack(f"<{len(counts)}I", *counts) + tid + eid + ids.astype("<i4").tobytes()

    @classmethod
    def decode(cls, message: bytes) -> "ExpectRecord":
        """Parse a peer's record; raises :class:`InvalidArgumentError` naming the field."""
        if not isinstance(message, (bytes, bytearray)) or len(message) < _HEADER.size:
            raise InvalidArgumentError(FIELD, f"not a kvxferd {FIELD}: {len(message or b'')} bytes")
        magic, version, num_groups, rank, tid_len, eid_len, num_tokens, deadline_ms, capability, push_key = \
            _HEADER.unpack_from(message)
        if magic != MAGIC:
            raise InvalidArgumentError(FIELD, f"not a kvxferd {FIELD}: starts with {bytes(message[:2])!r}")
        if version != VERSION:
            raise InvalidArgumentError(f"{FIELD}.version", f"unsupported version {version}")
        if not 1 <= num_groups <= MAX_GROUPS:
            raise InvalidArgumentError(f"{FIELD}.num_groups", f"{num_groups} outside [1, {MAX_GROUPS}]")
        if not (0 < tid_len <= MAX_ID_BYTES and 0 < eid_len <= MAX_ID_BYTES):
            raise InvalidArgumentError(FIELD, f"id lengths {tid_len}, {eid_len} outside [1, {MAX_ID_BYTES}]")
        if deadline_ms < 1:
            raise InvalidArgumentError(f"{FIELD}.deadline_ms", "must be at least 1")
        offset = _HEADER.size + 4 * num_groups
        if len(message) < offset:
            raise InvalidArgumentError(FIELD, f"{len(message)} bytes, shorter than its group counts")
        counts = struct.unpack_from(f"<{num_groups}I", message, _HEADER.size)
        num_ids = sum(counts)
        if num_ids > MAX_IDS:
            raise InvalidArgumentError(f"{FIELD}.block_ids", f"{num_ids} ids, at most {MAX_IDS}")
        if len(message) != offset + tid_len + eid_len + 4 * num_ids:
            raise InvalidArgumentError(FIELD, f"{len(message)} bytes, the header announces "
                                              f"{offset + tid_len + eid_len + 4 * num_ids}")
        try:
            transfer_id = bytes(message[offset:offset + tid_len]).decode()
            reader_engine_id = bytes(message[offset + tid_len:offset + tid_len + eid_len]).decode()
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(FIELD, f"ids are not UTF-8: {err}") from None
        ids = np.frombuffer(message, dtype="<i4", count=num_ids, offset=offset + tid_len + eid_len).astype(np.int64)
        if num_ids and ids.min() < 0:
            raise InvalidArgumentError(f"{FIELD}.block_ids", "block ids must not be negative")
        bounds = np.cumsum((0, *counts))
        block_ids = tuple(ids[bounds[g]:bounds[g + 1]] for g in range(num_groups))
        return cls(transfer_id, reader_engine_id, rank, block_ids, bytes(capability), deadline_ms / 1e3,
                   bytes(push_key), num_tokens or None)


def is_expectation(message: bytes) -> bool:
    """Whether a message to a holder's agent is an expectation (else a notice, or a hello)."""
    return message[:2] == MAGIC
