"""Reads are checked against the holder's board over real NIXL: a read of blocks no longer held fails as stale.

The holder's tag leaves the board before any end of the hold is returned
(tests/plan/test_leases.py); here the reader's one-sided check must see
that: a read of a held request passes, a read after the hold ended (never
held, released, consumed) fails with every read rank's blocks invalid, and
checks that wait for a free slot still end.
"""

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.verify.cluster import LocalCluster
from kvxferd.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.reads import ReadFailure


@pytest.fixture(scope="module")
def cluster():
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    with LocalCluster(prefill_groups, decode_groups, 2, 1, name="board") as cluster:
        yield cluster


def _request(cluster, request_id: str, seed: int):
    return random_request(request_id, cluster.prefill_groups, cluster.decode_groups, 48, np.random.default_rng(seed))


def _every_rank_stale(cluster, result, request) -> None:
    assert not result.ok and result.failure is ReadFailure.STALE and "stale read" in result.error
    read_ranks = tuple(r.remote_rank for r in cluster.executors[0].remote(cluster.prefill_id).plan.plan_request(request).reads)
    assert result.failed_ranks == read_ranks and result.num_bytes == 0
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)


def test_a_held_read_passes_and_an_unheld_one_is_stale(cluster):
    held = _request(cluster, "held", 1)
    cluster.reset_decode()
    (result,) = cluster.read(held)
    assert result.ok and cluster.check(held) == []
    for q in range(2):
        assert cluster.holder_thread.wait_end(q, held.remote_request_id).kind == "CONSUMED"
    (result,) = cluster.read(_request(cluster, "never-held", 2), hold=False)
    _every_rank_stale(cluster, result, _request(cluster, "never-held", 2))


def test_a_released_or_consumed_hold_makes_the_next_read_stale(cluster):
    request = _request(cluster, "released", 3)
    for holder in cluster.holders:
        holder.hold(request.remote_request_id, request.remote_block_ids, 60)
    with cluster.holders[1].lock:
        cluster.holders[1].holds.release(request.remote_request_id)
    (result,) = cluster.read(request, hold=False)
    assert not result.ok and result.failure is ReadFailure.STALE and result.failed_ranks == (1,)
    # Rank 0 still held it: it hears that the read failed and ends the hold (its only reader reported).
    end = cluster.holder_thread.wait_end(0, request.remote_request_id)
    assert end.kind == "CONSUMED" and end.failed_readers == ((cluster.decode_id, 0),)
    # Rank 1 gets no notice: its hold had ended, and a notice could only count for a later hold of the id.
    cluster.holders[1].hold(request.remote_request_id, request.remote_block_ids, 60)
    assert cluster.holder_thread.wait_end(1, request.remote_request_id, timeout_s=0.3) is None
    assert cluster.holders[1].counts.late == 0
    with cluster.holders[1].lock:
        cluster.holders[1].holds.release(request.remote_request_id)
    consumed = _request(cluster, "consumed", 4)
    assert cluster.read(consumed)[0].ok
    assert all(cluster.holder_thread.wait_end(q, consumed.remote_request_id).kind == "CONSUMED" for q in range(2))
    (again,) = cluster.read(consumed, hold=False)  # the same request read again after it was consumed
    _every_rank_stale(cluster, again, consumed)


def test_checks_wait_for_a_free_slot_and_all_end(cluster):
    """One free check slot for eight reads of two ranks each: every check still runs, one after another."""
    executor = cluster.executors[0]
    checks = executor.checks
    taken = [checks._free.pop() for _ in range(checks.num_free - 1)]
    try:
        requests = [_request(cluster, f"queued-{n}", 10 + n) for n in range(8)]
        for request in requests:
            for holder in cluster.holders:
                holder.hold(request.remote_request_id, request.remote_block_ids, 60)
        inflight = [executor.post(cluster.prefill_id, request) for request in requests]
        results = [executor.wait(f, 10) for f in inflight]
        assert [r.error for r in results] == [None] * 8 and checks.num_free == 1
    finally:
        checks._free.extend(taken)


def test_a_connect_that_fails_halfway_unloads_what_it_loaded(cluster):
    """The second rank's metadata is garbage: the first rank's agent was loaded into both the reader's agent
    and its notice agent, and both references go again. (A new connect drops the old link first, as a
    re-handshake does, so nothing at all stays loaded.)"""
    executor = cluster.executors[0]
    assert (executor.agent.num_remotes(), executor.notices.num_remotes()) == (2, 2)
    good = cluster.prefill_agents[0].metadata()
    with pytest.raises(InvalidArgumentError):
        executor.connect([engine.cache for engine in cluster.prefill], [good, b"nixlSerDes|garbage"],
                         [holder.board for holder in cluster.holders])
    assert (executor.agent.num_remotes(), executor.notices.num_remotes()) == (0, 0)
    cluster.connect()
    assert (executor.agent.num_remotes(), executor.notices.num_remotes()) == (2, 2)
    assert cluster.read(_request(cluster, "after-bad-connect", 30))[0].ok
