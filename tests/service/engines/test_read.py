"""A read's state only moves forward: ACCEPTED -> POSTED -> ENDED -> DELIVERED, and never back."""

from __future__ import annotations

import time
import types

import numpy as np

from kvxferd.plan.engine import ReadRequest
from kvxferd.service.engines.read import Read, ReadState
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.records import ReadResult

ORDER = list(ReadState)


class _Feed:
    """A completion feed whose direct path takes a write (``direct``) or refuses it."""

    def __init__(self, direct: bool) -> None:
        self.direct, self.direct_writes, self.queued = direct, [], []

    def put_direct(self, completion, taken=None):
        if not self.direct:
            return False
        taken()
        self.direct_writes.append(completion.request_id)
        return True

    def put(self, completion):
        self.queued.append(completion.request_id)


class _TracedRead(Read):
    """Records every state it is given."""

    def __setattr__(self, name, value):
        if name == "state":
            self.__dict__.setdefault("states", []).append(value)
        super().__setattr__(name, value)


def _ended_read(direct: bool) -> _TracedRead:
    slot = types.SimpleNamespace(completions=_Feed(direct), executor=None)
    request = ReadRequest("r", "r@p", (np.arange(2),), (np.arange(2),))
    now = time.perf_counter()
    read = _TracedRead(slot, "p", request, None, now, now + 1)
    read.end(ReadResult("r", "p", True, 8, 1, 0.0, (np.zeros(0, np.int64),)), ReadFailure.NONE)
    return read


def test_a_direct_write_the_sink_cannot_take_leaves_the_read_ended_until_the_loop_queues_it():
    read = _ended_read(direct=False)
    assert not read.complete(queue=False) and read.state is ReadState.ENDED
    assert read.complete(queue=True) and read.state is ReadState.DELIVERED and read.slot.completions.queued == ["r"]
    assert read.states == [ReadState.ACCEPTED, ReadState.ENDED, ReadState.DELIVERED]
    assert [ORDER.index(s) for s in read.states] == sorted(ORDER.index(s) for s in read.states)


def test_a_direct_write_delivers_before_the_engine_can_answer_it():
    read = _ended_read(direct=True)
    assert read.complete(queue=False) and read.state is ReadState.DELIVERED
    assert read.slot.completions.direct_writes == ["r"] and read.states[-1] is ReadState.DELIVERED
    # Negative control: the trace sees a backward move where one is made.
    read.state = ReadState.ENDED
    assert [ORDER.index(s) for s in read.states] != sorted(ORDER.index(s) for s in read.states)
