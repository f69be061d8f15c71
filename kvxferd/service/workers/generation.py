"""What one worker generation is: the regions it maps, how it came up or ended, and the pause before
the next one after a death (kvxferd.service.workers.supervisor keeps them coming)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

log = logging.getLogger("kvxferd.workers")

# A worker dies when a peer owns it through its metadata (a READ of an unmapped address), or UCX aborts.
# Giving up would hand whoever can kill it a way to end the engine's service; restarting at once would
# hand them a CPU sink (a start costs about 0.85 s of a core: kvxferd bench processes). So: the first
# FREE_RESTARTS deaths in a row start again at once, each further one waits twice as long, up to
# MAX_BACKOFF_S (then a killer costs the daemon at most ~5 % of a core). A generation that lived
# STABLE_S ends the streak.
FREE_RESTARTS = 3
STABLE_S = 60.0
BACKOFF_BASE_S = 0.5
MAX_BACKOFF_S = 16.0


def backoff_s(num_deaths_in_a_row: int, free_restarts: int = FREE_RESTARTS, base_s: float = BACKOFF_BASE_S,
              max_s: float = MAX_BACKOFF_S) -> float:
    """The pause before the next start after ``num_deaths_in_a_row`` deaths, none after STABLE_S of life::

        deaths  1..free   free+1   free+2   free+3  ...  capped
        pause   0         base     2 base   4 base  ...  max_s
    """
    beyond = num_deaths_in_a_row - free_restarts
    return 0.0 if beyond <= 0 else min(max_s, base_s * 2.0 ** (beyond - 1))


@dataclass(frozen=True)
class Region:
    """One piece of an engine's memory to serve: ``num_bytes`` of ``fd`` from ``offset`` (any alignment)."""

    fd: int
    num_bytes: int
    offset: int = 0


@dataclass(frozen=True)
class WorkerUp:
    """A generation that mapped its regions."""

    generation: int
    pid: int
    metadata: bytes = field(repr=False)
    addresses: tuple[int, ...]
    start_s: float  # from exec to its answer
    notices_metadata: bytes = field(default=b"", repr=False)  # its notice agent's (the engine as a reader)
    sandbox: str = ""  # how the worker confined itself ("landlock ABI n", or "off: why")


@dataclass(frozen=True)
class WorkerDeath:
    """A generation that ended, and how."""

    generation: int
    pid: int
    returncode: int  # negative: the signal that killed it
    noticed_s: float  # time.monotonic() when the supervisor saw its channel end


def read_only_copy(fd: int) -> int:
    """``fd``'s file opened again read-only: a worker can neither write it nor change its size (a shrunk
    object would fault whoever maps it here, the engine included). Reopening checks permissions again: a
    file this user may not open itself (another user's, passed as an fd) is shared as passed, with a warning."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        log.warning("a region's file cannot be reopened read-only by the daemon's user: its worker gets the "
                    "engine's own descriptor (it could change the file's size)")
        return os.dup(fd)
