"""A rank's phase only moves forward; a failure keeps its first reason and drains while a handle runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvxferd.plan.engine import RankRead
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.rankstate import RankPhase, RankTransfer

P = RankPhase


def _rank(phase: RankPhase = P.ADMITTING) -> RankTransfer:
    return RankTransfer(RankRead(0, np.zeros(1, np.int32), np.zeros(1, np.int32), 8), tag=7, phase=phase)


# Every move the rank machine makes (rankmachine.py), and nothing else, goes forward.
MACHINE_MOVES = {(P.ADMITTING, P.CHECKING), (P.ADMITTING, P.MOVING), (P.CHECKING, P.MOVING), (P.MOVING, P.RECHECKING),
                 (P.MOVING, P.DONE), (P.RECHECKING, P.RECHECKING), (P.RECHECKING, P.DONE)}


@pytest.mark.parametrize("before, after", list(itertools.product(P, P)))
def test_enter_moves_forward_only(before, after):
    rank = _rank(before)
    forward = after > before or (after == before == P.RECHECKING)
    if (before, after) in MACHINE_MOVES:
        assert forward
    if forward:
        rank.enter(after, None)
        assert rank.phase is after
    else:  # negative control: a backward (or repeated) move is refused, the phase unchanged
        with pytest.raises(RuntimeError):
            rank.enter(after, None)
        assert rank.phase is before


def test_a_failure_drains_while_its_handle_runs_and_keeps_its_first_reason():
    rank = _rank(P.MOVING)
    rank.handle = handle = object()
    rank.fail("deadline", ReadFailure.DEADLINE)
    assert rank.phase is P.DRAINING and not rank.ended
    rank.fail("later", ReadFailure.ABORTED)  # no second reason
    assert (rank.error, rank.failure) == ("deadline", ReadFailure.DEADLINE)
    assert rank.drained() is handle and rank.phase is P.FAILED and rank.ended and rank.handle is None
    idle = _rank(P.ADMITTING)
    idle.fail("stale", ReadFailure.STALE)
    assert idle.phase is P.FAILED  # nothing ran: failed at once
    done = _rank(P.RECHECKING)
    done.enter(P.DONE)
    done.fail("too late", ReadFailure.ABORTED)
    assert done.phase is P.DONE and done.error == ""  # an ended rank stays as it ended


def test_needs_check_before_the_data_and_after_it_only_without_a_running_check():
    assert _rank(P.ADMITTING).needs_check and _rank(P.RECHECKING).needs_check
    assert not _rank(P.MOVING).needs_check and not _rank(P.CHECKING).needs_check
    running = _rank(P.RECHECKING)
    running.handle = object()
    assert not running.needs_check
