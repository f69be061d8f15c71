"""The channel between the control plane and one data-plane worker (issue #55, docs/dataplane.md).

A ``SOCK_SEQPACKET`` socket pair: message boundaries kept by the kernel, a
peer's death seen as end of file. One message is a JSON object with an
``op``, at most :data:`MAX_MESSAGE_BYTES`, with up to :data:`MAX_FDS` file
descriptors beside it (``SCM_RIGHTS``)::

    control plane ──► worker                      worker ──► control plane
    map    {name, regions: [{file, offset,         mapped   {metadata (hex), addresses}
            num_bytes}], poll_interval_s}           (each file mapped whole and read-only, each
            + one fd per file                       region's bytes registered: their addresses)
                                                    {.., notices_metadata (hex)}: its notice agent
    pace   {poll_interval_s}                       (no answer)
    load   {metadata (hex)}: a holder, for notices (no answer; error if NIXL refuses it)
    unload {agent}  connect {agent}                (no answer)
    notify {notices: [[agent, hex]]}               (no answer; a batch, at most MAX_NOTICES)
    ping   {}                                      pong     {}
    stop   {}                                      notices  {notices: [[sender, hex]]} (one-way)
                                                   error    {message}

A reader worker (``map`` with ``role: reader`` and the cache's description: its files mapped
read-write) takes the commands of :mod:`kvxferd.worker.reads` instead of ``load`` .. ``notify``:
``connect {id, ..}`` (answered ``connected``/``error`` with that id), ``probe``, ``abort_probe``,
``post {id, request}`` (answered ``ended {id, ..}``), ``abort``, ``disconnect``, ``release_host``.

Neither side trusts the other's bytes further than this module's checks:
a worker may be owned by whoever holds its NIXL metadata.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import threading
from typing import Any

from kvxferd.errors import InvalidArgumentError

MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 253  # the kernel's SCM_MAX_FD: regions of one engine rank's cache (and its board), an fd each
MAX_NOTICES = 256  # per notices or notify message
MAX_NOTICE_BYTES = 4096  # a read notice: a 28-byte header, a capability, two ids of up to 256 characters (UTF-8)
MAX_NAME_CHARS = 1024  # an agent name (xfer/nixl/agent.py's MAX_AGENT_NAME_BYTES)


class ChannelClosed(Exception):
    """The other side is gone (end of file, reset)."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = (), *,
         block: bool = True) -> None:
    """Send one message (and ``fds``) whole; ``block=False``: :class:`BlockingIOError` when the other side
    has not read what was sent before (its buffer is full)."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidArgumentError("message", f"{len(data)} bytes, the worker channel carries {MAX_MESSAGE_BYTES}")
    try:
        flags = 0 if block else socket.MSG_DONTWAIT
        if fds:
            socket.send_fds(sock, [data], list(fds), flags)
        else:
            sock.send(data, flags)
    except (BrokenPipeError, ConnectionResetError) as err:
        raise ChannelClosed(str(err)) from None


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it; :class:`ChannelClosed` at end of file. A message that
    is not a JSON object with a string ``op`` is :class:`InvalidArgumentError` (its fds closed)."""
    buffer = _receive_buffer()
    try:
        num_bytes, ancillary, flags, _ = sock.recvmsg_into([buffer], _FDS_SPACE)
    except ConnectionResetError as err:
        raise ChannelClosed(str(err)) from None
    fds = _fds_of(ancillary)
    data = bytes(memoryview(buffer)[:num_bytes])
    if not data and not fds:
        raise ChannelClosed("end of file")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE_BYTES:
            raise InvalidArgumentError("message", "longer than the worker channel carries, or too many fds")
        try:
            message = json.loads(data)
        except ValueError:
            raise InvalidArgumentError("message", "not JSON") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise InvalidArgumentError("message", "not an object with a string op")
    except InvalidArgumentError:
        close_all(fds)
        raise
    return message, fds


_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_buffers = threading.local()


def _receive_buffer() -> bytearray:
    """This thread's receive buffer, made once: ``socket.recv_fds`` maps and unmaps a fresh 1 MiB buffer
    on every call, a fifth of a worker's CPU at 300 notices a second (docs/benchmarks.md)."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = bytearray(MAX_MESSAGE_BYTES + 1)
    return buffer


def _fds_of(ancillary: list) -> list[int]:
    """The fds of ``SCM_RIGHTS`` ancillary data (as ``socket.recv_fds`` reads them)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return list(fds)


def close_all(fds: list[int]) -> None:
    """Close fds that came with a message nobody will use."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


INLINE_BLOB_BYTES = 256 << 10  # bytes sent in a message as hex; beyond, in a sealed memfd beside it


def blob_fields(data: bytes, key: str, fd_index: int = 0) -> tuple[dict[str, Any], list[int]]:
    """``data`` as fields of a message, and the fds to send with it: ``{key: hex}`` up to INLINE_BLOB_BYTES,
    beyond that ``{key + "_fd": fd_index, key + "_bytes": n}`` and one sealed memfd holding it (a message
    carries at most MAX_MESSAGE_BYTES), which goes at ``fd_index`` of the message's fds."""
    if len(data) <= INLINE_BLOB_BYTES:
        return {key: data.hex()}, []
    fd = os.memfd_create(f"kvxferd-{key}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view, written = memoryview(data), 0
        while written < len(view):
            written += os.write(fd, view[written:])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return {f"{key}_fd": fd_index, f"{key}_bytes": len(data)}, [fd]


def blob_of(message: dict[str, Any], key: str, fds: list[int] | tuple[int, ...], max_bytes: int) -> bytes:
    """The bytes :func:`blob_fields` put in ``message`` (the memfd, if so, one of ``fds``), at most
    ``max_bytes``; :class:`InvalidArgumentError` naming ``key`` otherwise (``fds`` stay the caller's)."""
    if f"{key}_fd" not in message:
        text = message.get(key)
        if not isinstance(text, str) or len(text) > 2 * max_bytes:
            raise InvalidArgumentError(key, f"hex of at most {max_bytes} bytes")
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise InvalidArgumentError(key, "not hex") from None
    index, num_bytes = message[f"{key}_fd"], message.get(f"{key}_bytes")
    if not isinstance(index, int) or not 0 <= index < len(fds) or not isinstance(num_bytes, int) \
            or not 0 <= num_bytes <= max_bytes:
        raise InvalidArgumentError(f"{key}_fd", f"one memfd of at most {max_bytes} bytes, among the fds sent")
    try:
        data = os.pread(fds[index], num_bytes, 0)
    except OSError as err:
        raise InvalidArgumentError(f"{key}_fd", f"not readable: {err.strerror}") from None
    if len(data) != num_bytes:
        raise InvalidArgumentError(f"{key}_fd", f"{len(data)} bytes, said {num_bytes}")
    return data


def notices_of(message: dict[str, Any]) -> list[tuple[str, bytes]]:
    """The ``(agent name, notice bytes)`` pairs of a ``notices`` message (a worker's: their senders) or a
    ``notify`` batch (the control plane's: their receivers), checked."""
    pairs, num_bad = notify_entries(message)
    if num_bad:
        raise InvalidArgumentError("notices", "each a [name, hex] pair within bounds")
    return pairs


def notify_entries(message: dict[str, Any]) -> tuple[list[tuple[str, bytes]], int]:
    """The pairs of a ``notify`` batch, and how many entries were skipped as out of bounds: one bad
    notice costs only itself (its hold ends EXPIRED), not the other holders' notices beside it."""
    notices = message.get("notices")
    if not isinstance(notices, list) or len(notices) > MAX_NOTICES:
        raise InvalidArgumentError("notices", f"a list of at most {MAX_NOTICES}")
    pairs = [_pair(entry) for entry in notices]
    return [p for p in pairs if p is not None], pairs.count(None)


def _pair(entry: Any) -> tuple[str, bytes] | None:
    """``[name, hex]`` within bounds as ``(name, bytes)``; None otherwise."""
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], str)
            and len(entry[0]) <= MAX_NAME_CHARS and len(entry[1]) <= 2 * MAX_NOTICE_BYTES):
        return None
    try:
        return entry[0], bytes.fromhex(entry[1])
    except ValueError:
        return None
