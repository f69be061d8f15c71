"""The hold board against a brute-force model: a multiset of tags, each in one of its two buckets."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError, ResourceExhaustedError
from kvxferd.plan.board import (BUCKET_BYTES, MAX_BOARD_BUCKETS, SLOTS_PER_BUCKET, HoldBoard, bucket_pair, buckets_for,
                                check_num_buckets, hold_tag, tag_in)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([2, 4, 16]), st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120))
def test_board_matches_a_multiset_of_tags(num_buckets, ops):
    """Adds and removes in any order: the board holds exactly the model's tags, each in one of its buckets,
    and refuses an add only when both of its buckets are full."""
    board, model = HoldBoard(num_buckets), collections.Counter()
    for add, n in ops:
        tag = hold_tag(f"req-{n}".encode())
        first, second = bucket_pair(tag, num_buckets)
        if add:
            full = all(np.count_nonzero(board.words[b]) == SLOTS_PER_BUCKET for b in (first, second))
            if full:
                with pytest.raises(ResourceExhaustedError):
                    board.add(tag)
            else:
                board.add(tag)
                model[tag] += 1
        else:
            board.remove(tag)
            if model[tag]:
                model[tag] -= 1
        found = collections.Counter(int(w) for w in board.words.ravel() if w)
        assert found == +model and board.num_tags == sum(model.values())
        for t in model:  # every tag lies in one of its own two buckets
            assert board.contains(t) == (model[t] > 0)
            rows = np.flatnonzero((board.words == np.uint64(t)).any(axis=1))
            assert set(rows.tolist()) <= set(bucket_pair(t, num_buckets))


def test_tags_and_buckets():
    assert all(hold_tag(f"r{n}".encode()) != 0 for n in range(1000)) and hold_tag(b"a") == hold_tag(b"a") != hold_tag(b"b")
    for n in range(1000):
        first, second = bucket_pair(hold_tag(f"r{n}".encode()), 8)
        assert first != second and 0 <= first < 8 and 0 <= second < 8
    assert BUCKET_BYTES == 64 and HoldBoard(4).words.nbytes == 4 * BUCKET_BYTES
    words = np.zeros((2, SLOTS_PER_BUCKET), np.uint64)
    words[1, 7] = np.uint64(2**64 - 1)
    assert tag_in(words, 2**64 - 1) and not tag_in(words, 5)


def test_sized_for_the_hold_limit_at_most_half_full():
    for max_holds in (1, 7, 8, 100, 100_000):
        num_buckets = buckets_for(max_holds)
        assert num_buckets & (num_buckets - 1) == 0 and num_buckets * SLOTS_PER_BUCKET >= 2 * max_holds
    board = HoldBoard(buckets_for(100_000))
    for n in range(100_000):  # the daemon's default limit: every hold fits
        board.add(hold_tag(f"request-{n}".encode()))
    assert board.num_tags == 100_000


@pytest.mark.parametrize("num_buckets", [0, 1, 3, 6, MAX_BOARD_BUCKETS * 2])
def test_a_peers_board_size_is_checked(num_buckets):
    with pytest.raises(InvalidArgumentError) as err:
        check_num_buckets(num_buckets, "hold_board.num_buckets")
    assert err.value.field == "hold_board.num_buckets"
