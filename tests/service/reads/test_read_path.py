"""ReadPath's choice of where a read is posted: a batch posts at most INLINE_MAX_BYTES on the event loop in
all (the copy blocks the loop), the rest goes to the data-plane thread; a new batch starts a new budget.
A read of a Reads batch that goes there goes unplanned (the thread plans it); a refusal from there
becomes the read's completion."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.engine import EngineTransferPlan, ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.service.engines.completions import CompletionFeed
import grpc

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.dataplane.thread import INLINE_MAX_BYTES
from kvxferd.service.engines.read import ReadState
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.records import ReadResult
from kvxferd.service.reads.path import ReadPath
from kvxferd.rig.verify.buffers import paper_cache


class _DataPlane:
    def __init__(self) -> None:
        self.here, self.there, self.unplanned = [], [], []

    def post_now(self, read):
        self.here.append(read.request_id)
        return False  # as if handed over: not ended yet

    def submit(self, read):
        self.there.append(read.request_id)
        if read.planned is None:
            self.unplanned.append(read.request_id)


def _path():
    spec = AttentionSpec("packed_HND", num_blocks=64, num_kv_heads=8, head_size=128, block_size=16)
    groups = (CacheGroup("full", spec, 2),)
    plan = EngineTransferPlan(paper_cache("d", groups, 1, 0), [paper_cache("p", groups, 1, 0)])
    link = types.SimpleNamespace(remote=types.SimpleNamespace(plan=plan, hold_keys=(), agent_names=("p.0",)), ready=True)
    slot = types.SimpleNamespace(reads={}, completions=CompletionFeed(), links={"p": link})
    config = types.SimpleNamespace(max_reads_per_engine=1000, deadline_s=30.0, max_deadline_s=600.0,
                                   require_digests=False)
    counter = types.SimpleNamespace(inc=lambda *args: None, observe=lambda *args: None)
    counter.labels = lambda *args: counter
    metrics = types.SimpleNamespace(read_failures=counter, read_duration=counter, read_post=counter,
                                    read_descriptors=counter, read_bytes=counter, stale_reads=counter,
                                    digest_checked_bytes=counter)
    daemon = types.SimpleNamespace(config=config, dataplane=_DataPlane(), metrics=metrics,
                                   spans=types.SimpleNamespace(on=False),  # (OpenTelemetry off)
                                   registry=types.SimpleNamespace(check_accepting=lambda: None))
    return ReadPath(daemon), slot, plan, daemon.dataplane


def _request(n: int, num_blocks: int) -> ReadRequest:
    ids = np.arange(num_blocks) + (n % 2) * num_blocks
    return ReadRequest(f"r{n}", f"r{n}@p", (ids,), (ids,))


def test_a_batch_posts_at_most_its_budget_on_the_loop():
    path, slot, plan, dataplane = _path()
    num_bytes = plan.plan_request(_request(0, 8)).num_bytes  # 8 blocks x 2 layers x 64 KiB: 1 MiB
    assert num_bytes == INLINE_MAX_BYTES
    path.begin_batch()
    for n in range(3):
        path.submit(slot, "p", _request(n, 8), 0.0, 0.0)
    assert dataplane.here == ["r0"] and dataplane.there == ["r1", "r2"]
    path.begin_batch()  # the next batch: a budget of its own
    path.submit(slot, "p", _request(3, 4), 0.0, 0.0)
    path.submit(slot, "p", _request(4, 4), 0.0, 0.0)
    path.submit(slot, "p", _request(5, 1), 0.0, 0.0)
    assert dataplane.here == ["r0", "r3", "r4"] and dataplane.there == ["r1", "r2", "r5"]


def test_a_batch_hands_its_large_reads_over_unplanned():
    path, slot, plan, dataplane = _path()
    path.begin_batch()
    for n in range(3):
        path.submit(slot, "p", _request(n, 8), 0.0, 0.0)
    assert dataplane.here == ["r0"] and dataplane.there == ["r1", "r2"] and dataplane.unplanned == ["r1", "r2"]
    assert set(slot.reads) == {"r0", "r1", "r2"}  # all in flight (the fake post_now ended nothing)
    assert all(read.state is ReadState.ACCEPTED for read in slot.reads.values())


def test_a_refusal_from_the_data_plane_thread_is_the_reads_completion():
    path, slot, plan, dataplane = _path()
    path.submit(slot, "p", _request(1, 16), 0.0, 0.0)
    assert dataplane.unplanned == ["r1"]
    err = InvalidArgumentError("local_block_ids", "block id 99 out of range")
    read = slot.reads["r1"]
    read.end_unposted(str(err), ReadFailure.REFUSED, refusal=err)  # as the thread does
    path.done([read])
    [completion] = list(slot.completions._queued)
    assert completion.request_id == "r1" and not completion.ok and "out of range" in completion.error
    assert completion.refused_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "r1" not in slot.reads
    assert read.state is ReadState.DELIVERED


def _ended(slot, request_id: str, ok: bool = True):
    """The engine's read of ``request_id``, ended as the data-plane thread ends it."""
    read = slot.reads[request_id]
    result = ReadResult(request_id, "p", ok, 1024, 2, 0.001, (), () if ok else (0,), None if ok else "rank 0: gone")
    read.end(result, ReadFailure.NONE if ok else ReadFailure.TRANSFER)
    return read


def test_an_id_whose_completion_the_thread_wrote_may_come_again_before_the_loop_caught_up():
    path, slot, plan, dataplane = _path()
    path.submit(slot, "p", _request(1, 2), 0.0, 0.0)
    with pytest.raises(InvalidArgumentError, match="already in flight"):
        path.submit(slot, "p", _request(1, 2), 0.0, 0.0)
    first = _ended(slot, "r1")
    with pytest.raises(InvalidArgumentError, match="already in flight"):  # ended, its completion not written
        path.submit(slot, "p", _request(1, 2), 0.0, 0.0)
    first.state = ReadState.DELIVERED  # as Read.complete on the data-plane thread, before the loop's done()
    path.submit(slot, "p", _request(1, 2), 0.0, 0.0)  # the engine has its completion: a new read, same id
    second = slot.reads["r1"]
    assert second is not first
    path.done([first])
    assert slot.reads["r1"] is second  # the first read's done() leaves the second's record alone
    path.done([_ended(slot, "r1")])
    assert "r1" not in slot.reads


def test_the_loop_writes_an_ok_completion_at_once_and_a_failed_one_after_marking_the_link_stale():
    async def main():
        path, slot, plan, dataplane = _path()
        link = slot.links["p"]
        link.stale = False
        sent: list[tuple[str, bool]] = []
        sink = types.SimpleNamespace(direct=True, writable=True, closed=False,
                                     send=lambda cs: sent.extend((c.request_id, link.stale) for c in cs) or True)
        pump = asyncio.ensure_future(slot.completions.pump(sink, 8, lambda: False))
        await asyncio.sleep(0)
        for n in (1, 2):
            path.submit(slot, "p", _request(n, 2), 0.0, 0.0)
        path.done([_ended(slot, "r1")])
        assert sent == [("r1", False)]  # written within done(): no wait for the pump's turn
        path.done([_ended(slot, "r2", ok=False)])
        assert sent == [("r1", False)] and link.stale  # queued, not written at once
        await asyncio.sleep(0)
        assert sent == [("r1", False), ("r2", True)] and not slot.reads
        pump.cancel()

    asyncio.run(main())
