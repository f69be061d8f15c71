"""The reader's board checks: one small READ of a holder's board per rank read, after the data READ.

::

    data READ from holder q ends ──► take a check slot (two buckets of this area)
                                 ──► READ buckets b0, b1 of q's board into it (2 x 64 B)
                                 ──► tag there: the hold was alive after the data arrived
                                     tag gone:  stale, the rank's blocks are invalid

The area is host memory registered with the reader's agent, one prepared
list of 64-byte descriptors, so a check is ``make_prepped_xfer`` with four
ids. Slots are reused; when all are taken a check waits for one (bounded
memory, nothing lost).
"""

from __future__ import annotations

import numpy as np

from kvxferd.plan.board import BUCKET_BYTES, SLOTS_PER_BUCKET, bucket_pair, check_num_buckets, tag_in
from kvxferd.xfer.agent import NixlAgent

CHECK_AREA_KEY = "board-checks"
NUM_CHECK_SLOTS = 2048  # checks in flight at once (256 KiB): beyond that a check waits for a slot


def board_rows(address: int, num_buckets: int) -> np.ndarray:
    """A holder's board as one strided row: ``num_buckets`` descriptors of one bucket each."""
    check_num_buckets(num_buckets)
    return np.array([[address, BUCKET_BYTES, 0, BUCKET_BYTES, num_buckets]], dtype=np.uint64)


class CheckArea:
    """Where the checks of one reader agent land. Slots are taken (``list.pop``) and given back
    (``append``) atomically, so the event loop and the data-plane thread may both post checks."""

    def __init__(self, agent: NixlAgent, num_slots: int = NUM_CHECK_SLOTS) -> None:
        self.agent = agent
        self.words = np.zeros((2 * num_slots, SLOTS_PER_BUCKET), np.uint64)
        agent.register_array(CHECK_AREA_KEY, self.words)
        try:
            self.local_list = agent.prep_local(board_rows(self.words.ctypes.data, len(self.words)), "DRAM")
        except BaseException:
            agent.deregister(CHECK_AREA_KEY)
            raise
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def post(self, remote_list, num_buckets: int, tag: int):
        """Post the check of ``tag`` on a board prepared as ``remote_list``: None when
        every slot is taken (try again once a check ended); ``(handle, slot, state)`` when posted. Raises
        :class:`NixlError` (the slot given back)."""
        try:
            slot = self._free.pop()
        except IndexError:
            return None
        handle = None
        try:
            handle = self.agent.make_read(self.local_list, np.array([2 * slot, 2 * slot + 1], np.int32), remote_list,
                                          np.array(bucket_pair(tag, num_buckets), np.int32), b"")
            state = self.agent.post(handle)
        except BaseException:
            if handle is not None:
                self.agent.release(handle)
            self._free.append(slot)
            raise
        return handle, slot, state

    def found(self, slot: int, tag: int) -> bool:
        """Whether the check that landed in ``slot`` saw ``tag``."""
        return tag_in(self.words[2 * slot:2 * slot + 2], tag)

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def close(self) -> None:
        """Release the list and deregister (every check released first)."""
        self.local_list.release()
        self.local_list = None
        self.agent.deregister(CHECK_AREA_KEY)
