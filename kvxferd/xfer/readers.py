"""The readers introduced to one holder rank: whose notices count, for whom, and for how long (issue #53, M2).

A reader is an engine rank of another daemon (``(reader engine id, rank)``)
that introduced the NIXL agent its notices come from. Each introduction is
kept under the **peer identity** that made it (its certificate identity with
TLS; ``""`` without: every daemon of the host is one identity)::

    (reader engine id, rank) ──► {identity A: agent a1, identity B: agent b1}
    notice from agent a1 naming (R, 0) ──► A's entry: counts (b1's would count too, for B's entry)

Identities never collide: another allowed identity that names a reader
first (or later) makes an entry of its own, so it can neither hold the
reader's owner out nor take over its notices. The same identity naming a
reader it introduced already either confirms it (the same agent) or
**replaces** its agent (a restarted reader): the caller logs that.

Holds count readers by ``(engine id, rank)``, whoever introduced them
(:class:`kvxferd.plan.leases.HoldTable`): a reader counts once per hold, so
two entries for one reader never end a hold early, and the hold still ends
exactly once.

Room is bounded twice: at most ``max_readers`` entries per holder rank and
``max_per_identity`` per identity. Every entry remembers when it was last
active: introduced (again), or a notice of its agent that carried a live
hold's capability (an unsealed or stale notice is not activity). An entry
idle for ``idle_s`` has **expired**: it still counts its reader's notices (a
valid one makes it active again), but it is the first to go when its
identity, or the rank, needs room for a new reader; room is never taken from
an active entry. So one identity that fills its own share (made-up readers
it keeps introducing) refuses only itself, and filling the whole rank takes
``max_readers / max_per_identity`` allowed identities kept active.

Thread-safety: introductions run on the event loop, notices on the
data-plane thread; one lock guards the table (a dict lookup or an
``OrderedDict`` move each time).
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from dataclasses import dataclass

from kvxferd.errors import ResourceExhaustedError

ReaderKey = tuple[str, int]  # (reader engine id, reader TP rank)


@dataclass(frozen=True)
class Reader:
    """A reader engine rank introduced to the holder (by an authenticated peer daemon)."""

    agent_name: str  # only this NIXL agent's notices count for the reader (its notice agent)
    tp_size: int
    expected_readers: int  # reader ranks of that engine that notify this rank per request
    identity: str = ""  # the peer identity that introduced it ("": the host's peer secret); only it may replace it


@dataclass(frozen=True)
class ReaderLimits:
    """How many readers a holder rank keeps, and when one has expired (the daemon's configuration)."""

    max_readers: int = 1024  # max_readers_per_engine
    max_per_identity: int = 256  # max_readers_per_identity
    idle_s: float = 600.0  # reader_idle_s


class Introduced(str, enum.Enum):
    """What an introduction did to the table."""

    NEW = "new"  # a reader (for this identity) not known before
    AGAIN = "again"  # the same agent introduced again: only its activity moved
    REPLACED = "replaced"  # the same identity named another agent: the old one's notices count no more

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Introduction:
    """The outcome of :meth:`ReaderTable.introduce`."""

    outcome: Introduced
    replaced_agent: str = ""  # REPLACED: the agent whose notices no longer count
    evicted: tuple[tuple[str, str, int], ...] = ()  # (identity, engine id, rank) of expired entries that made room


@dataclass(eq=False)
class _Entry:
    reader: Reader
    active_s: float  # time.monotonic() of its last activity


class ReaderTable:
    """Introduced readers of one holder rank, by identity (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_reader: dict[ReaderKey, dict[str, _Entry]] = {}
        # identity -> its entries, least recently active first (moved to the end on activity)
        self._by_identity: dict[str, collections.OrderedDict[ReaderKey, _Entry]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: ReaderKey) -> bool:
        return bool(self._by_reader.get(key))

    def get(self, key: ReaderKey, identity: str = "") -> Reader | None:
        """The reader ``identity`` introduced under ``key`` (None if none)."""
        with self._lock:
            entry = self._by_reader.get(key, {}).get(identity)
            return None if entry is None else entry.reader

    def count(self, identity: str) -> int:
        """How many readers ``identity`` has introduced (and still has)."""
        with self._lock:
            return len(self._by_identity.get(identity, ()))

    def copy(self) -> "ReaderTable":
        """A table with the same entries (tests restore a holder's readers with it)."""
        table = ReaderTable()
        with self._lock:
            for identity, entries in self._by_identity.items():
                for key, entry in entries.items():
                    table._add(identity, key, _Entry(entry.reader, entry.active_s))
        return table

    def introduce(self, key: ReaderKey, reader: Reader, limits: ReaderLimits = ReaderLimits(),
                  now: float | None = None) -> Introduction:
        """Count ``reader``'s notices for ``key`` under ``reader.identity`` from now on; what that did.

        Raises :class:`ResourceExhaustedError` naming ``max_readers_per_identity`` or
        ``max_readers_per_engine`` when the identity or the rank has no room that an expired entry
        could give up (nothing changes then)."""
        now = time.monotonic() if now is None else now
        identity = reader.identity
        with self._lock:
            entries = self._by_identity.get(identity)
            known = entries.get(key) if entries is not None else None
            if known is not None:
                old, known.reader, known.active_s = known.reader, reader, now
                entries.move_to_end(key)
                if old.agent_name == reader.agent_name:
                    return Introduction(Introduced.AGAIN)
                return Introduction(Introduced.REPLACED, replaced_agent=old.agent_name)
            evicted = self._make_room(identity, limits, now)
            self._add(identity, key, _Entry(reader, now))
            return Introduction(Introduced.NEW, evicted=evicted)

    def _make_room(self, identity: str, limits: ReaderLimits, now: float) -> tuple[tuple[str, str, int], ...]:
        """Drop the expired entries a new one of ``identity`` needs room from, or raise (dropping nothing)."""
        def expired(entry: _Entry) -> bool:
            return now - entry.active_s >= limits.idle_s

        victims: list[tuple[str, ReaderKey]] = []
        own = self._by_identity.get(identity, {})
        if len(own) >= limits.max_per_identity:
            key, entry = next(iter(own.items()))
            if not expired(entry):
                raise ResourceExhaustedError("max_readers_per_identity", f"{limits.max_per_identity} readers "
                                             f"introduced by this peer identity were active in the last "
                                             f"{limits.idle_s:g} s")
            victims.append((identity, key))
        if self._size - len(victims) >= limits.max_readers:
            oldest = None  # (identity, key, entry): the least recently active entry of any identity, not a victim
            for other, entries in self._by_identity.items():
                for key, entry in entries.items():
                    if (other, key) not in victims:
                        if oldest is None or entry.active_s < oldest[2].active_s:
                            oldest = (other, key, entry)
                        break  # the first one left of each identity is its least recently active
            if oldest is None or not expired(oldest[2]):
                raise ResourceExhaustedError("max_readers_per_engine", f"{limits.max_readers} readers are "
                                             f"introduced already, all active in the last {limits.idle_s:g} s")
            victims.append(oldest[:2])
        for other, key in victims:
            self._remove(other, key)
        return tuple((other, *key) for other, key in victims)

    def _add(self, identity: str, key: ReaderKey, entry: _Entry) -> None:
        self._by_identity.setdefault(identity, collections.OrderedDict())[key] = entry
        self._by_reader.setdefault(key, {})[identity] = entry
        self._size += 1

    def _remove(self, identity: str, key: ReaderKey) -> None:
        entries = self._by_identity[identity]
        del entries[key]
        if not entries:
            del self._by_identity[identity]
        by_identity = self._by_reader[key]
        del by_identity[identity]
        if not by_identity:
            del self._by_reader[key]
        self._size -= 1

    def sender_reader(self, key: ReaderKey, sender: str, expected_readers: int | None = None) -> Reader | None:
        """The reader ``key`` introduced with agent ``sender`` (by any identity): whose notice this is. Should
        two identities name one agent (one copied the other's name), the entry expecting the notice's count
        of readers is taken, so a copy cannot get the real reader's notices refused."""
        with self._lock:
            entries = self._by_reader.get(key)
            if not entries:
                return None
            matching = [e.reader for e in entries.values() if e.reader.agent_name == sender]
        return next((r for r in matching if r.expected_readers == expected_readers), matching[0] if matching else None)

    def refresh(self, key: ReaderKey, identity: str, now: float | None = None) -> bool:
        """Whether ``identity`` still has reader ``key`` here; if so it was active now. For a reader's daemon
        asking, e.g. with its periodic probe, so that it can introduce the reader again when its place was
        taken (an idle reader gives it up), before its notices are dropped."""
        with self._lock:
            entries = self._by_identity.get(identity)
            entry = entries.get(key) if entries is not None else None
            if entry is None:
                return False
            entry.active_s = time.monotonic() if now is None else now
            entries.move_to_end(key)
            return True

    def touch(self, key: ReaderKey, reader: Reader, now: float) -> None:
        """``reader`` (as :meth:`sender_reader` found it) was active at ``now``; nothing if it was replaced or
        dropped meanwhile."""
        with self._lock:
            entries = self._by_identity.get(reader.identity)
            entry = entries.get(key) if entries is not None else None
            if entry is not None and entry.reader is reader:
                entry.active_s = now
                entries.move_to_end(key)
