"""A hold board's pages in a sealed memfd: what the holder writes, a worker registers, a same-host reader maps.

::

    holder daemon                       its data-plane worker        a same-host reader (issue #37)
    ─────────────                       ─────────────────────        ──────────────────────────────
    HoldTable writes tags ─► memfd ◄─── mapped, registered     ◄──── /proc/<holder>/fd/<fd>, mapped
                                        (peers READ it)              read-only: checks are two loads

A reader on another host checks a hold with a NIXL READ of the board; one on
the holder's host that proved it (kvxferd.wire.samehost) maps the board and
reads the two buckets itself, as it copies the blocks themselves.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from kvxferd.plan.board import board_shape
from kvxferd.plan.groups import HostShare


@dataclass(eq=False)
class BoardMemory:
    """A hold board's words in a memfd, kept across a worker's deaths; written only by this process."""

    fd: int
    mapping: mmap.mmap = field(repr=False)
    words: np.ndarray = field(repr=False)

    @classmethod
    def create(cls, num_buckets: int) -> "BoardMemory":
        """A sealed memfd (it can neither shrink nor grow: a worker or reader that tried would otherwise make
        this process's next tag write fault) holding a zeroed board."""
        shape = board_shape(num_buckets)
        num_bytes = int(np.prod(shape)) * 8
        fd = os.memfd_create("kvxferd-hold-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, num_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, num_bytes)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, mapping, np.frombuffer(mapping, dtype=np.uint64).reshape(shape))

    def share(self) -> HostShare:
        """How a same-host reader opens it: this process's fd, and the object's identity to check."""
        status = os.fstat(self.fd)
        return HostShare("", 0, status.st_dev, status.st_ino, os.getpid(), self.fd)

    def close(self) -> None:
        """Close the fd; the pages go with the last view of them (the hold table's board holds one)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
