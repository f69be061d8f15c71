"""A sleep that another thread can cut short, at the cost of a plain sleep.

Polling threads (the daemon's data plane, the holder thread) sleep between
rounds for 20 µs to 0.5 s and must wake at once when work arrives. A
``threading.Event.wait(timeout)`` costs 17-30 µs of CPU per wake-up on
the project's 2-core machine (a Python condition variable, a lock made per
wait); ``select`` on an eventfd costs 14-18 µs and ``time.sleep`` 11-16 µs
(``kvxferd bench floors``, several runs). At 6 000 wake-ups a second every
10 µs saved is 6 % of a core.

``set`` marks the waker and writes the fd only when it was not marked, so a
burst of submissions costs one syscall; ``wait`` checks the mark before it
blocks, so a ``set`` is never lost between the check and the ``select``.
"""

from __future__ import annotations

import os
import select
import weakref


class Waker:
    """An eventfd to sleep on; :meth:`set` from any thread, :meth:`wait` from one."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds = [self._fd]
        self._is_set = False
        # Closed when the waker is collected: never while another thread may still call set().
        weakref.finalize(self, os.close, self._fd)

    def set(self) -> None:
        """Wake the waiting thread now (or make its next :meth:`wait` return at once)."""
        if not self._is_set:
            self._is_set = True
            os.eventfd_write(self._fd, 1)

    def wait_any(self, timeout_s: float | None, fds: list[int]) -> list[int]:
        """:meth:`wait`, also woken by any of ``fds`` (each below ``select``'s FD_SETSIZE) turning
        readable: those that did (``[]`` when woken by :meth:`set` or the timeout). ``select``, not
        ``poll``: the latter sleeps whole milliseconds, and the data plane sleeps 20 µs at times."""
        if not fds:
            self.wait(timeout_s)
            return []
        if self._is_set:
            self._consume()
            return []
        try:
            readable, _, _ = select.select([self._fd, *fds], [], [], timeout_s)
        except (OSError, ValueError):  # one of fds closed under us: the caller's next round drops it
            self.wait(timeout_s)
            return []
        if self._fd in readable:
            self._consume()
            readable.remove(self._fd)
        return readable

    def wait(self, timeout_s: float | None) -> bool:
        """Sleep up to ``timeout_s`` (``None``: until set); True when woken by :meth:`set`."""
        if not self._is_set:
            readable, _, _ = select.select(self._fds, [], [], timeout_s)
            if not readable:
                return False
        self._consume()
        return True

    def _consume(self) -> None:
        self._is_set = False
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:  # marked, fd not written yet by the setter: the mark is what counts
            pass
