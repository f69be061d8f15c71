"""UCX's TCP sockets as the wake-up of the thread that drives an agent (issue #58).

Over UCX's TCP transport a READ of our memory moves only while our agent makes
progress (UCX emulates it with messages our worker must answer). Polling the
agent every millisecond made every round trip across hosts wait half a
millisecond on average, three times per read, and cost the holder about 5 % of
a core while readers were about. Instead, the thread that drives the agent
sleeps on the epoll sets in which UCX's TCP transport keeps its sockets: one
is readable when a peer's bytes arrive (a READ request, a notice) or when a
socket UCX waits to write to drains. Measured between two namespace hosts
(``kvxferd bench floors --hosts``): a 64-byte READ 0.17 ms at p50 instead of
1.0 ms, for 90 µs of the holder's CPU instead of 410 µs.

NIXL's own progress thread sleeps on the same sets and was as fast, but it
spins a whole core, beyond our reach, while a peer that connected stops
before its connection is set up: UCX keeps a write pending on a writable
socket. Such a set fires again at once however often it is served; this
module mutes it (:class:`WakeSets`) and the caller polls on its short timer
(1 ms) until the set calms down. A stream of bytes arriving faster than a round
reads them (a bulk WRITE into our memory) looks the same and is polled so too:
at 1 ms a socket's buffer still carries it.

NIXL does not hand out these sets, so they are found as the epoll fds an
agent's creation opened (``/proc/self/fd``) whose every target is a socket
(UCX's own event thread keeps another set, of sets). Nothing found (another
OS, another UCX transport, a UCX that keeps its sockets otherwise) leaves the
caller on its timer, as before: slower, never wrong.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import termios
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
_FDS = "/proc/self/fd"
_MADE = threading.Lock()  # one creation at a time is told apart from another's sets
SELECTABLE_FDS = 1024  # select()'s FD_SETSIZE: a set numbered above is not used (the timer serves its agent)
STREAK_LIMIT = 4  # rounds in a row after which a set still readable counts as one that fires for nothing
MUTE_MIN_S, MUTE_MAX_S = 1e-3, 0.05  # how long such a set is left out, doubling while it keeps firing


def _eventpolls() -> dict[int, tuple[int, ...]]:
    """This process's epoll fds and the fds each watches (Linux; elsewhere nothing)."""
    found: dict[int, tuple[int, ...]] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"{_FDS}/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                found[int(name)] = tuple(int(line.split()[1]) for line in info if line.startswith("tfd:"))
        except (OSError, ValueError, IndexError):
            continue  # closed meanwhile, or not readable: not ours to use
    return found


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"{_FDS}/{fd}").startswith("socket:")
    except OSError:
        return False


def socket_sets_made_by(make: Callable[[], T]) -> tuple[T, tuple[int, ...]]:
    """Call ``make`` (an agent's creation) and return what it made with the epoll fds it opened that
    watch sockets only: the sets UCX's TCP transport keeps its sockets in. A failing ``make`` raises."""
    with _MADE:
        before = _eventpolls()
        made = make()
        after = _eventpolls()
    sets = tuple(sorted(fd for fd, targets in after.items() if fd not in before and fd < SELECTABLE_FDS
                        and targets and all(_is_socket(t) for t in targets)))
    return made, sets


def _moving(fd: int) -> bool:
    """Bytes move on a socket of set ``fd``: some arrived unread, or some sent wait for the peer
    (``SIOCOUTQ``). A set still readable after its round is then a stream, not a stuck set-up (which has
    nothing to read and nothing in flight: UCX waits on a writable socket)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            targets = [int(line.split()[1]) for line in info if line.startswith("tfd:")]
        if targets and select.select(targets, [], [], 0)[0]:
            return True
        queued = array.array("i", [0])
        for target in targets:
            fcntl.ioctl(target, termios.TIOCOUTQ, queued, True)  # SIOCOUTQ on a socket
            if queued[0] > 0:
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


class WakeSets:
    """The socket sets a thread sleeps on, less those that fire for nothing (not thread-safe: one
    thread waits, checks and asks)::

        wait(live())  ->  woken sets  ->  the round serves their agents  ->  after_round(woken)
                                           still readable right after, with no byte moving on its
                                           sockets? STREAK_LIMIT times in a row: muted MUTE_MIN_S,
                                           doubling to MUTE_MAX_S while it goes on

    A set that keeps UCX busy (a stream of bytes in or out) is not muted: bytes wait to be read on one
    of its sockets, or wait in one's send queue.
    """

    def __init__(self) -> None:
        self._streaks: dict[int, int] = {}
        self._muted_until_s: dict[int, float] = {}
        self._mute_s: dict[int, float] = {}
        self.num_mutes = 0  # times a set was muted, ever

    def live(self, fds: Iterable[int], now_s: float | None = None) -> list[int]:
        """``fds`` less the muted ones."""
        if not self._muted_until_s:
            return list(fds)
        now_s = time.perf_counter() if now_s is None else now_s
        return [fd for fd in fds if self._muted_until_s.get(fd, 0.0) <= now_s]

    def any_muted(self, fds: Iterable[int] | None = None, now_s: float | None = None) -> bool:
        """Some set (of ``fds``, default: any) is muted now: its agent has traffic the caller must poll for
        on its short timer meanwhile (a stream arriving faster than a round reads it looks the same)."""
        if not self._muted_until_s:
            return False
        now_s = time.perf_counter() if now_s is None else now_s
        fds = self._muted_until_s if fds is None else fds
        return any(self._muted_until_s.get(fd, 0.0) > now_s for fd in fds)

    def is_muted(self, fd: int, now_s: float | None = None) -> bool:
        now_s = time.perf_counter() if now_s is None else now_s
        return self._muted_until_s.get(fd, 0.0) > now_s

    def after_round(self, woken: list[int]) -> None:
        """The sets that woke this round were served: any still readable counts toward muting."""
        if not woken:
            return
        try:
            still, _, _ = select.select(woken, [], [], 0)
        except (OSError, ValueError):  # closed under us (its agent went): forget it
            still = []
            for fd in woken:
                self.forget(fd)
        now_s = time.perf_counter()
        for fd in woken:
            if fd not in still or _moving(fd):
                self._streaks[fd] = 0
                self._mute_s.pop(fd, None)  # calm again (or busy for real): the next mute starts short
                continue
            self._streaks[fd] = streak = self._streaks.get(fd, 0) + 1
            if streak >= STREAK_LIMIT:
                mute_s = min(self._mute_s.get(fd, MUTE_MIN_S / 2) * 2, MUTE_MAX_S)
                self._mute_s[fd], self._muted_until_s[fd], self._streaks[fd] = mute_s, now_s + mute_s, 0
                self.num_mutes += 1

    def forget(self, fd: int) -> None:
        """``fd`` is no longer a set of ours (its agent closed)."""
        self._streaks.pop(fd, None)
        self._muted_until_s.pop(fd, None)
        self._mute_s.pop(fd, None)
