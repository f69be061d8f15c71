"""Frames of the reads socket: a protobuf message behind its length.

The reads socket (``<engine_socket>.reads``, a UNIX stream socket) carries
the same batches as the gRPC ``Reads`` stream without gRPC's framework
around them::

    ┌──────────────┬─────────────────────────────┐
    │ length: u32  │ ReadBatch (engine -> daemon)│  the first names engine_id and session
    │ little-endian│ CompletionBatch (back)      │  the daemon's last one may carry end_code
    └──────────────┴─────────────────────────────┘

Pure: no sockets here, only bytes in and out.
"""

from __future__ import annotations

import struct

from kvxferd.errors import ResourceExhaustedError

HEADER = struct.Struct("<I")
# A session's numbering and batches, as both ends of the daemon keep them (the control plane's feed,
# service/engines/completions.py, and a reader worker's, worker/session.py):
COMPLETIONS_PER_BATCH = 256  # at most this many completions in one CompletionBatch, on either transport
MAX_SEQ = 1 << 62  # an engine's ack_seq numbering may go on from is below this (a seq is a uint64)


def reads_socket_path(engine_socket: str) -> str:
    """Where a daemon with engine socket ``engine_socket`` takes its engines' read batches."""
    return engine_socket + ".reads"


def encode_frame(payload: bytes) -> bytes:
    """One frame: the payload behind its length."""
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into frame payloads; a frame over ``max_frame_bytes`` is refused before it is
    buffered (the length comes first), so a peer can make it hold at most one frame's worth."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads that ``data`` completed, in order (raises ResourceExhaustedError on a frame too big)."""
        buffer = self._buffer
        buffer += data
        payloads, start = [], 0
        while len(buffer) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            if length > self.max_frame_bytes:
                raise ResourceExhaustedError("frame", f"a frame of {length} bytes; the limit is "
                                                      f"{self.max_frame_bytes} (max_message_bytes)")
            end = start + HEADER.size + length
            if end > len(buffer):
                break
            payloads.append(bytes(buffer[start + HEADER.size:end]))
            start = end
        del buffer[:start]
        return payloads

    @property
    def buffered(self) -> bytes:
        """A copy of the bytes of a frame not complete yet (whoever reads the stream on goes on from them)."""
        return bytes(self._buffer)

    def take_buffered(self) -> bytes:
        """The bytes of a frame not complete yet, taken out."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes of a frame not complete yet."""
        return len(self._buffer)
