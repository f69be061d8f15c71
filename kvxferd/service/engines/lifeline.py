"""An engine process's pidfd: the daemon lets go of an engine the moment its process exits.

A lease alone keeps a dead engine's memory mapped (and registered with NIXL)
until it runs out: 15 s for the vLLM connector, up to ``max_lease_s``. An
engine that passes a pidfd of its own process with its fds
(``RegisterRequest.process_fd_index``, made with ``pidfd_open(getpid())``)
is watched instead: the kernel makes the pidfd readable when the process
exits, and the registration is taken down at once::

    engine ──fd socket──► [region fds..., pidfd] ──► daemon: loop.add_reader(pidfd)
    engine exits (SIGKILL too) ─► pidfd readable ─► deregister: unmapped, NIXL deregistered

A pidfd names its process across PID namespaces (a sidecar need not share
the engine's). An fd that is not a pidfd, or one of a process that has
already exited, is refused. An engine could pass another process's pidfd:
that only ties its own registration to that process; the lease still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from kvxferd.errors import InvalidArgumentError


def process_of(fd: int, field: str, *, exited_ok: bool = False) -> int:
    """The pid a pidfd names (as this daemon's PID namespace sees it; 0: not visible here, -1: exited);
    refuses other fds, and exited processes unless ``exited_ok``."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
    except OSError as err:
        raise InvalidArgumentError(field, f"cannot inspect the fd: {err.strerror}") from None
    except ValueError:  # a line without a key: not fdinfo as Linux writes it
        raise InvalidArgumentError(field, "not a pidfd") from None
    pid = fields.get("Pid")
    if pid is None:
        raise InvalidArgumentError(field, "not a pidfd (make it with pidfd_open(getpid()))")
    try:
        pid = int(pid)
    except ValueError:
        raise InvalidArgumentError(field, "not a pidfd") from None
    if pid < 0 and not exited_ok:
        raise InvalidArgumentError(field, "the pidfd's process has exited")
    return pid


class ProcessWatch:
    """Calls ``on_exit`` (on the loop, once) when the process behind a pidfd exits; owns ``fd`` (closes it)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        self.fd = fd
        self.pid = process_of(fd, "process_fd_index", exited_ok=True)  # exited meanwhile: readable, fires at once
        self._loop, self._on_exit = loop, on_exit
        loop.add_reader(self.fd, self._exited)

    def _exited(self) -> None:
        on_exit, self._on_exit = self._on_exit, None
        self.close()
        if on_exit is not None:
            on_exit()

    def close(self) -> None:
        """Stop watching (idempotent; on the loop's thread)."""
        if self.fd >= 0:
            with contextlib.suppress(ValueError, OSError, RuntimeError):  # a loop already closed
                self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
