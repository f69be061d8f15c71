"""The hold board: which requests a holder rank holds now, readable by its readers without the holder.

A reader must not read blocks the holder no longer holds, nor count a read
as good if the holder freed the blocks under it. Instead of asking the
holder (a notification and an ack, both waiting for the holder's next
poll), the reader reads the holder's board with a one-sided READ before
its data READ (the hold is alive: post it; gone: nothing is copied) and
once more after it: if the hold's tag is still on the board, the holder
had not yet ended the hold, and it ends a hold (CONSUMED, EXPIRED,
released) only after clearing the tag.

The board is an array of buckets, each one cache line of eight 64-bit
slots. A tag is a 64-bit hash of the hold's capability (which seals the
request id and its exact block ids, :mod:`kvxferd.plan.capability`),
never 0 (0 is an empty slot): a later hold of the same request id on
other blocks has another tag, so a capability replayed after its hold
ended finds nothing. It lives in the emptier of two buckets chosen by the
tag, so a reader reads both (two descriptors of 64 bytes) and looks for it::

    tag = blake2b(capability)[:8]            b0 = tag & mask
                                             b1 = (tag >> 32) & mask, never b0
    bucket:  [ s0 | s1 | s2 | s3 | s4 | s5 | s6 | s7 ]   64 bytes, one READ descriptor
    board:   bucket 0, bucket 1, ..., bucket mask     (num_buckets a power of two)

Sized at most half full at the holder's hold limit; with two choices of
eight slots a full pair of buckets is then practically impossible, and if
it happens anyway the hold is refused (RESOURCE_EXHAUSTED), never lost.
Two holds with one tag are both kept (one slot each); a stale read can
pass only if another live hold of the same rank has its 64-bit tag.

Pure arithmetic on a numpy array; registering it with NIXL is the
transfer layer's business.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, ResourceExhaustedError
from kvxferd.plan.groups import HostShare

SLOTS_PER_BUCKET = 8
BUCKET_BYTES = SLOTS_PER_BUCKET * 8  # one cache line: a READ of one bucket never tears a slot
MAX_BOARD_BUCKETS = 1 << 24  # 1 GiB of board: far above any hold limit
_TAG_PERSON = b"kvxferd-tag-v1"


@dataclass(frozen=True)
class BoardInfo:
    """Where a holder rank's board lies, as its readers learn at the handshake."""

    address: int  # in the holder's process, registered with its NIXL agent
    num_buckets: int
    # Seals the capabilities of the holds listed on this board (kvxferd.plan.capability): a reader
    # checks a read's capability with it before posting. b"": not announced (refused by readers).
    hold_key: bytes = field(default=b"", repr=False)
    # The memfd the board lies in, for a proven same-host reader to map and check holds itself (issue
    # #37; kvxferd.xfer.boardmemory); None: checked with NIXL READs only.
    share: HostShare | None = None


def hold_tag(capability: bytes) -> int:
    """The board tag of a hold: 64 bits of its capability's hash, never 0."""
    tag = int.from_bytes(hashlib.blake2b(capability, digest_size=8, person=_TAG_PERSON).digest(), "little")
    return tag or 1


def bucket_pair(tag: int, num_buckets: int) -> tuple[int, int]:
    """The two buckets ``tag`` may live in (distinct when the board has more than one)."""
    mask = num_buckets - 1
    first, second = tag & mask, (tag >> 32) & mask
    if second == first:
        second = first ^ 1 if num_buckets > 1 else first
    return first, second


def buckets_for(max_holds: int) -> int:
    """Buckets for a hold limit: a power of two, the board at most half full."""
    need = -(-2 * max(1, max_holds) // SLOTS_PER_BUCKET)
    return min(MAX_BOARD_BUCKETS, 1 << max(1, (need - 1).bit_length()))


def check_num_buckets(num_buckets: int, field: str = "num_buckets") -> int:
    """A board size a peer announced: a power of two in [2, MAX_BOARD_BUCKETS]."""
    if not 2 <= num_buckets <= MAX_BOARD_BUCKETS or num_buckets & (num_buckets - 1):
        raise InvalidArgumentError(field, f"{num_buckets} buckets: not a power of two in [2, {MAX_BOARD_BUCKETS}]")
    return num_buckets


def board_shape(num_buckets: int) -> tuple[int, int]:
    """The board's words: one row of ``SLOTS_PER_BUCKET`` u64 tags per bucket."""
    return (num_buckets, SLOTS_PER_BUCKET)


def tag_in(buckets: np.ndarray, tag: int) -> bool:
    """Whether ``tag`` is in the buckets a reader read (any shape of uint64 words)."""
    return bool((buckets == np.uint64(tag)).any())


class HoldBoard:
    """The board of one holder rank (not thread-safe: the hold table's lock guards it)."""

    def __init__(self, num_buckets: int, words: np.ndarray | None = None) -> None:
        """``words``: memory of the caller's to keep the board in (zeros, :func:`board_shape`), e.g. pages a
        data-plane worker registers with NIXL (docs/dataplane.md); else the board allocates its own."""
        self.num_buckets = check_num_buckets(num_buckets)
        if words is None:
            words = np.zeros(board_shape(num_buckets), np.uint64)
        elif words.shape != board_shape(num_buckets) or words.dtype != np.uint64 or words.any():
            raise InvalidArgumentError("words", f"a board of {num_buckets} buckets starts as zeros of shape "
                                                f"{board_shape(num_buckets)}, uint64")
        self.words = words  # registered with NIXL as is
        self.num_tags = 0

    @property
    def num_bytes(self) -> int:
        return self.words.nbytes

    def add(self, tag: int) -> None:
        """Put ``tag`` in the emptier of its two buckets; refuses when both are full."""
        first, second = bucket_pair(tag, self.num_buckets)
        free = [np.flatnonzero(self.words[b] == 0) for b in (first, second)]
        bucket, slots = max(zip((first, second), free), key=lambda pair: len(pair[1]))
        if not len(slots):
            raise ResourceExhaustedError("hold_board", f"both buckets of this hold are full ({self.num_tags} holds "
                                                       f"on a board of {self.num_buckets} buckets)")
        self.words[bucket, slots[0]] = tag
        self.num_tags += 1

    def remove(self, tag: int) -> None:
        """Clear one slot holding ``tag`` (a tag not on the board is a no-op)."""
        for bucket in bucket_pair(tag, self.num_buckets):
            slots = np.flatnonzero(self.words[bucket] == np.uint64(tag))
            if len(slots):
                self.words[bucket, slots[0]] = 0
                self.num_tags -= 1
                return

    def contains(self, tag: int) -> bool:
        return tag_in(self.words[list(bucket_pair(tag, self.num_buckets))], tag)
