"""The reader's board checks: one small READ of a holder's board per rank read, after the data READ.

::

    data READ from holder q ends ──► take a check slot (two buckets of this area)
                                 ──► READ buckets b0, b1 of q's board into it (2 x 64 B)
                                 ──► tag there: the hold was alive after the data arrived
                                     tag gone:  stale, the rank's blocks are invalid

The area is host memory registered with the reader's agent, one prepared
list of 64-byte descriptors, so a check is ``make_prepped_xfer`` with four
ids. Slots are reused; when all are taken a check waits for one (bounded
memory, nothing lost). One remote engine holds at most a quarter of them:
a holder that stopped answering (its checks wait for their deadlines) must
not make the reads of every other holder wait for a slot.

A handshake probes each new connection the same way (:class:`BoardProbe`):
UCX sets up a connection's transports on its first transfer, which took
10-35 ms here, and that first transfer would otherwise be a request's read.
"""

from __future__ import annotations

import numpy as np

from kvxferd.plan.board import BUCKET_BYTES, SLOTS_PER_BUCKET, bucket_pair, check_num_buckets, tag_in
from kvxferd.xfer.handles import ReadFailure, TransferFailure
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState
from kvxferd.xfer.nixl.transfers import nixl_failure

CHECK_AREA_KEY = "board-checks"
PROBE_TAG = 1  # a probe reads some bucket pair; which one does not matter
NUM_CHECK_SLOTS = 2048  # checks in flight at once (256 KiB): beyond that a check waits for a slot


def board_rows(address: int, num_buckets: int) -> np.ndarray:
    """A holder's board as one strided row: ``num_buckets`` descriptors of one bucket each."""
    check_num_buckets(num_buckets)
    return np.array([[address, BUCKET_BYTES, 0, BUCKET_BYTES, num_buckets]], dtype=np.uint64)


class CheckArea:
    """Where the checks of one reader agent land. Not thread-safe: its executor's lock (ReadExecutor.lock)
    lets one thread at a time post and end checks."""

    def __init__(self, agent: NixlAgent, num_slots: int = NUM_CHECK_SLOTS, max_per_owner: int | None = None) -> None:
        self.agent = agent
        self.max_per_owner = max(1, num_slots // 4) if max_per_owner is None else max_per_owner
        self._owner_of: dict[int, object] = {}  # slot -> the remote engine whose check holds it
        self._num_owned: dict[object, int] = {}
        self.words = np.zeros((2 * num_slots, SLOTS_PER_BUCKET), np.uint64)
        agent.register_array(CHECK_AREA_KEY, self.words)
        try:
            self.local_list = agent.prep_local(board_rows(self.words.ctypes.data, len(self.words)), "DRAM")
        except BaseException:
            agent.deregister(CHECK_AREA_KEY)
            raise
        self._free = list(range(num_slots - 1, -1, -1))
        self._quarantine: list[tuple[object, int]] = []  # (handle, slot) of abandoned checks maybe still running

    @property
    def num_free(self) -> int:
        return len(self._free)

    def post(self, remote_list, num_buckets: int, tag: int, owner: object = None):
        """Post the check of ``tag`` on a board prepared as ``remote_list``: None when every slot is taken,
        or ``owner`` (a remote engine) holds its share already (try again once a check ended);
        ``(check, state)`` when posted. Raises :class:`NixlError` (the slot given back)."""
        if owner is not None:
            if self._num_owned.get(owner, 0) >= self.max_per_owner:
                return None
            self._num_owned[owner] = self._num_owned.get(owner, 0) + 1
        if self._quarantine and not self._free:
            self._reclaim()
        try:
            slot = self._free.pop()
        except IndexError:
            self._disown(owner)
            return None
        if owner is not None:
            self._owner_of[slot] = owner
        handle = None
        try:
            handle = self.agent.make_read(self.local_list, np.array([2 * slot, 2 * slot + 1], np.int32), remote_list,
                                          np.array(bucket_pair(tag, num_buckets), np.int32), b"")
            state = self.agent.post(handle)
        except BaseException:
            if handle is not None:
                self.agent.release(handle)
            self._disown(self._owner_of.pop(slot, None))
            self._free.append(slot)
            raise
        return BoardCheck(self, handle, slot, ended=state is not TransferState.PROC), state

    def _disown(self, owner: object) -> None:
        if owner is not None:
            left = self._num_owned[owner] - 1
            if left:
                self._num_owned[owner] = left
            else:
                del self._num_owned[owner]

    def found(self, slot: int, tag: int) -> bool:
        """Whether the check that landed in ``slot`` saw ``tag``."""
        return tag_in(self.words[2 * slot:2 * slot + 2], tag)

    def end(self, handle, slot: int, *, maybe_running: bool = False) -> None:
        """A posted check is over (done, failed or abandoned): release its handle, give its slot back.
        ``maybe_running``: it was abandoned, and UCX cannot stop its READ, whose bytes could land on a later
        check's: the slot waits in quarantine until NIXL says that READ ended."""
        self._disown(self._owner_of.pop(slot, None))
        if maybe_running:
            self._quarantine.append((handle, slot))
            return
        self._release(handle)
        self._free.append(slot)

    def _release(self, handle) -> None:
        try:
            self.agent.release(handle)
        except NixlError:
            pass  # the handle of a failed transfer may already be gone

    def _reclaim(self) -> None:
        """Free the quarantined slots whose READ ended."""
        for handle, slot in list(self._quarantine):
            if not self.agent.running(handle):
                self._quarantine.remove((handle, slot))
                self._release(handle)
                self._free.append(slot)

    def close(self) -> None:
        """Release the list and deregister (every check released first)."""
        for handle, _ in self._quarantine:
            self._release(handle)
        self._quarantine.clear()
        self.local_list.release()
        self.local_list = None
        self.agent.deregister(CHECK_AREA_KEY)


class BoardCheck:
    """A posted check (a :class:`kvxferd.xfer.handles.TransferHandle`): its two buckets land in one slot of
    the area. Released, it gives the slot back, or, while its READ may still run, quarantines it."""

    __slots__ = ("area", "handle", "slot", "_ended", "_failure")
    lands_in_blocks = False  # in the check area: an abandoned check never writes an engine's blocks

    def __init__(self, area: CheckArea, handle, slot: int, *, ended: bool) -> None:
        self.area, self.handle, self.slot, self._ended = area, handle, slot, ended
        self._failure = TransferFailure("board check: reading the holder's hold board failed", ReadFailure.TRANSFER)

    def state(self) -> TransferState:
        try:
            state = self.area.agent.state(self.handle)
        except NixlError as err:
            self._failure = TransferFailure(str(err), nixl_failure(err))
            state = TransferState.ERR
        self._ended = state is not TransferState.PROC
        return state

    def failure(self) -> TransferFailure:
        return self._failure

    def running(self) -> bool:
        if not self._ended:
            self._ended = not self.area.agent.running(self.handle)
        return not self._ended

    def found(self, tag: int) -> bool:
        """Whether the board showed ``tag`` (once the check is DONE)."""
        return self.area.found(self.slot, tag)

    def release(self) -> None:
        self.area.end(self.handle, self.slot, maybe_running=not self._ended)


class BoardProbe:
    """One READ of every remote rank's board (two buckets), posted when a connection is made.

    It proves at the handshake that each holder's memory answers, and it
    pays UCX's connection set-up there instead of in the first request's
    read (``docs/benchmarks.md``, "The first read after a handshake").
    """

    def __init__(self, area: CheckArea, boards: dict[int, tuple[object, int]]) -> None:
        """``boards``: remote rank -> (its prepared board list, its number of buckets)."""
        self.area = area
        self.waiting = dict(boards)  # not posted yet (no free slot)
        self.running: dict[int, BoardCheck] = {}
        self.errors: dict[int, str] = {}

    def poll(self) -> dict[int, str] | None:
        """None while a READ runs; then every rank's error (empty: every board answered)."""
        for q, (board_list, num_buckets) in list(self.waiting.items()):
            try:
                posted = self.area.post(board_list, num_buckets, PROBE_TAG)
            except NixlError as err:
                del self.waiting[q]
                self.errors[q] = str(err)
                continue
            if posted is None:
                break  # every slot taken by reads' checks: the next poll tries again
            del self.waiting[q]
            self.running[q] = posted[0]
        for q, check in list(self.running.items()):
            state = check.state()
            if state is TransferState.PROC:
                continue
            if state is TransferState.ERR:
                self.errors[q] = check.failure().error
            self.running.pop(q).release()
        return None if self.waiting or self.running else dict(self.errors)

    def abort(self, reason: str) -> None:
        """Give up every READ still running (the connection is being released, or the probe timed out):
        their slots wait in quarantine until those READs end."""
        for q in [*self.waiting, *self.running]:
            self.errors.setdefault(q, reason)
        for check in self.running.values():
            check.running()  # ended meanwhile: its slot is free at once, else quarantined
            check.release()
        self.running.clear()
        self.waiting.clear()
