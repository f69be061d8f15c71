"""The holder's half of the data plane: the hold board, readers' notices in, holds ended exactly once.

One :class:`Holder` per engine rank whose memory others read. It keeps the
rank's hold board (:mod:`kvxferd.plan.board`) in host memory registered with
the rank's agent, so readers check their holds with a one-sided READ and no
reader waits for this side. The daemon's data-plane thread and the
in-process test cluster (verify.holderthread) drive the same class, so the NIXL test matrix
exercises the daemon's board and notice path::

    Hold        ──► HoldTable.hold: tag onto the board, then held
    notice from agent A ──► decode (typed errors: counted, dropped)
                        ──► A introduced for that reader (by any identity)?  no: dropped, counted
                        ──► HoldTable.record (the holder's own reader count)
                        ──► sealed for a live hold: the reader was active (kvxferd.xfer.readers)
                        ──► HoldEnd: FAILED reader (hold lives on), CONSUMED (last reader;
                            its tag left the board first)

Notices are untrusted: nothing a notice says can end a hold early or count
for a reader that was not introduced over an authenticated channel. Nothing
is sent back, so a notice can make this side send nothing.

A notice also says whether the reader's READs needed this side's progress
(UCX over TCP emulates a READ with messages the holder must answer; over
shared memory the reader copies alone). :meth:`Holder.wants_progress` tells
the daemon's data-plane thread to poll fast while some reader may need it,
and slowly (only to count notices) otherwise::

    introduce(reader)          wanted for READER_SETUP_S (its handshake's probe over a new connection)
    notice, READs waited       wanted for PROGRESS_WANTED_S from now
    notice ok, READs alone     not wanted for that reader (a failed read proves nothing)

A reader can only speak for itself: its notices set or clear its own entry,
never another's, and only from the agent it was introduced with. Who
introduced which reader, how many each peer identity may, and when an idle
one gives up its place: :mod:`kvxferd.xfer.readers`.
"""

from __future__ import annotations

import collections
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError
from kvxferd.plan.board import BoardInfo, HoldBoard, buckets_for
from kvxferd.plan.capability import HOLD_KEY_BYTES
from kvxferd.plan.leases import FAILED, LATE_NOTICE, HoldEnd, HoldTable
from kvxferd.plan.expectrecord import ExpectRecord
from kvxferd.plan.notifications import HELLO, ReadNotice
from kvxferd.xfer.boardmemory import BoardMemory
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.readers import Introduction, Reader, ReaderLimits, ReaderTable

log = logging.getLogger(__name__)


class NoticeEvent(str, enum.Enum):
    """What became of a notice the holder did not simply count. The value is the metric's label: the
    ``reason`` of ``kvxferd_notices_dropped`` for the :attr:`dropped` ones."""

    BAD = "malformed"  # undecodable or inconsistent: dropped
    FOREIGN = "foreign"  # from an agent not introduced for that reader: dropped
    UNSEALED = "unsealed"  # without the hold's capability: dropped
    LATE = "late"  # a successful read's notice after its hold had ended: counts for nothing
    WAITED = "waited"  # the reader's READs waited for our progress (we poll fast)

    def __str__(self) -> str:  # the value in text and f-strings, as the plain string was
        return self.value

    @property
    def dropped(self) -> bool:
        """The notice was thrown away unread (``kvxferd_notices_dropped``)."""
        return self in (NoticeEvent.BAD, NoticeEvent.FOREIGN, NoticeEvent.UNSEALED)


@dataclass
class NoticeCounts:
    """How many notices of each :class:`NoticeEvent` the holder saw (``counts[event]``);
    ``on_add(event)`` (the daemon's metrics) sees each one."""

    by_event: collections.Counter = field(default_factory=collections.Counter)
    on_add: Callable[[NoticeEvent], None] | None = field(default=None, repr=False, compare=False)

    def __getitem__(self, event: NoticeEvent) -> int:
        return self.by_event[event]

    def add(self, event: NoticeEvent) -> None:
        """Count one notice of ``event``."""
        self.by_event[event] += 1
        if self.on_add is not None:
            self.on_add(event)


BOARD_KEY = "hold-board"
PROGRESS_WANTED_S = 10.0  # a reader whose READs waited for our progress keeps polling fast this long
READER_SETUP_S = 0.5  # a newly introduced reader gets fast polls this long (or until it reads alone)


@dataclass(eq=False)
class Holder:
    """Holds of one engine rank, its board and the readers introduced to it; ``lock`` guards ``holds``.

    The board is sized for ``max_holds`` and registered with ``agent`` here;
    :meth:`close` deregisters it (before the agent closes).
    """

    agent: NixlAgent
    max_holds: int = 100_000
    max_hold_s: float = float("inf")  # a hold's whole life, renewals included
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Introduced readers, by (reader engine id, rank) and the identity that introduced them. Written by
    # whoever introduces readers, read here (the table has its own lock).
    readers: ReaderTable = field(default_factory=ReaderTable)
    counts: NoticeCounts = field(default_factory=NoticeCounts)
    holds: HoldTable = field(init=False)
    # reader -> time.monotonic() until which its READs may need our progress. Written by introduce (the
    # event loop) and on_notice (the polling thread): single sets and pops, atomic under the GIL; one
    # entry per introduced reader at most (a reader introduced again replaces its own).
    progress_wanted: dict[tuple[str, int], float] = field(default_factory=dict)
    # The board's pages (a memfd a same-host reader may map: kvxferd.xfer.boardmemory). Given: the
    # giver's, which it closes (a data-plane worker's, docs/dataplane.md); None: made here, and ours.
    board_memory: BoardMemory | None = field(default=None, repr=False)
    board_registered_elsewhere: bool = False  # a data-plane worker registers it, not ``agent``

    def __post_init__(self) -> None:
        self._owns_board = self.board_memory is None
        if self.board_memory is None:
            self.board_memory = BoardMemory.create(buckets_for(self.max_holds))
        # A fresh key per registration: capabilities of a former registration's holds mean nothing here.
        board = HoldBoard(buckets_for(self.max_holds), self.board_memory.words)
        self.holds = HoldTable(secrets.token_bytes(HOLD_KEY_BYTES), board, self.max_hold_s)
        try:
            self._board_share = self.board_memory.share()
            if not self.board_registered_elsewhere:
                self.agent.register_array(BOARD_KEY, board.words)
        except BaseException:
            if self._owns_board:
                self.board_memory.close()
            raise

    @property
    def hold_key(self) -> bytes:
        """What seals this rank's holds; given to authenticated, introduced readers only."""
        return self.holds.hold_key

    @property
    def board(self) -> BoardInfo:
        """The board as readers learn it (its share goes only to proven same-host readers: encode_info)."""
        words = self.holds.board.words
        return BoardInfo(words.ctypes.data, len(words), self.holds.hold_key, self._board_share)

    def close(self) -> None:
        """Deregister the board (its holds are ended by whoever ends them: :meth:`HoldTable.drop_all`)."""
        if not self.board_registered_elsewhere:
            self.agent.deregister(BOARD_KEY)
        if self._owns_board:
            self.board_memory.close()

    def introduce(self, key: tuple[str, int], reader: Reader, *, reads_here: bool = True,
                  limits: ReaderLimits = ReaderLimits(), now: float | None = None) -> Introduction:
        """Count ``reader``'s notices from now on (by its agent's name, under ``reader.identity``; raises
        :class:`~kvxferd.errors.ResourceExhaustedError` past ``limits``) and, when it reads this rank, poll
        fast for its handshake's probe: over UCX on TCP that READ of our board waits for our progress.
        A reader rank the TP mapping never sends here gets no fast polls (any thread). Returns what the
        introduction did (a new reader, the same again, or another agent replacing the reader's)."""
        introduction = self.readers.introduce(key, reader, limits, now)
        for identity, engine_id, rank in introduction.evicted:  # their notices count no more: say why
            log.info("an idle reader gave up its place to a new one", extra={
                "holder_agent": self.agent.name, "reader": f"{engine_id}/{rank}", "identity": identity,
                "reader_idle_s": limits.idle_s})
        if reads_here:
            self.progress_wanted[key] = (time.monotonic() if now is None else now) + READER_SETUP_S
        else:
            self.progress_wanted.pop(key, None)
        return introduction

    def wants_progress(self, now: float | None = None) -> bool:
        """Some reader may need this side's progress now (see the module doc): poll fast."""
        if not self.progress_wanted:
            return False
        now = time.monotonic() if now is None else now
        return any(until > now for until in list(self.progress_wanted.values()))  # list(): one atomic copy

    def on_notice(self, sender: str, message: bytes, now: float | None = None) -> list[HoldEnd]:
        """Count one reader's notice; the events to publish: a FAILED reader and/or the hold's CONSUMED end."""
        if message == HELLO:
            return []  # a reader's new connection warming up: nothing to count
        try:
            notice = ReadNotice.decode(message)
        except InvalidArgumentError:
            self.counts.add(NoticeEvent.BAD)
            return []
        key = (notice.reader_engine_id, notice.reader_rank)
        reader = self.readers.sender_reader(key, sender, notice.expected_readers)
        if reader is None:
            # Not from an agent introduced for that reader: dropped, so a forged notice cannot end a hold.
            self.counts.add(NoticeEvent.FOREIGN)
            return []
        now = time.monotonic() if now is None else now
        if not notice.alone:
            self.progress_wanted[key] = now + PROGRESS_WANTED_S
            self.counts.add(NoticeEvent.WAITED)
        elif notice.ok:
            self.progress_wanted.pop(key, None)
        try:
            with self.lock:
                outcome = self.holds.record(notice, now, reader.expected_readers)
        except InvalidArgumentError:
            self.counts.add(NoticeEvent.BAD)
            outcome = None
        except PermissionDeniedError:  # a reader naming a hold it was not given: counts for nothing
            self.counts.add(NoticeEvent.UNSEALED)
            outcome = None
        if outcome is not None and not outcome.alive and notice.ok:
            self.counts.add(NoticeEvent.LATE)  # the reader judged its read by the board; this notice only came late
        if outcome is not None and outcome.alive:  # it carried a live hold's capability: the reader is active
            self.readers.touch(key, reader, now)
        events = []
        if outcome is not None and not outcome.alive:  # for a push's decode side: this writer is done (never published)
            events.append(HoldEnd(notice.request_id, FAILED, (), LATE_NOTICE, (key,)))
        if outcome is not None and outcome.failed:
            events.append(HoldEnd(notice.request_id, FAILED, (),
                                  f"reader {notice.reader_engine_id}/{notice.reader_rank} failed"))
        if outcome is not None and outcome.end is not None:
            events.append(outcome.end)
        return events

    def expectation(self, sender: str, message: bytes) -> tuple[ExpectRecord, str] | None:
        """A push's expectation (:mod:`kvxferd.plan.expectrecord`) from the agent introduced for its decode
        rank, and the peer identity that introduced that agent (its push target is that identity's); None
        (counted: undecodable ``BAD``, from any other agent ``FOREIGN``)."""
        try:
            record = ExpectRecord.decode(message)
        except InvalidArgumentError:
            self.counts.add(NoticeEvent.BAD)
            return None
        reader = self.readers.sender_reader((record.reader_engine_id, record.reader_rank), sender)
        if reader is None:
            self.counts.add(NoticeEvent.FOREIGN)
            return None
        return record, reader.identity

    def hold(self, request_id: str, block_ids: tuple, lease_s: float, now: float | None = None) -> bytes:
        """Start holding a request's blocks for its readers (its tag goes onto the board first); the capability."""
        with self.lock:
            return self.holds.hold(request_id, block_ids, lease_s, time.monotonic() if now is None else now)
