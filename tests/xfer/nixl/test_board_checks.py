"""Reads are checked against the holder's board over real NIXL: a read of blocks no longer held fails as stale.

The holder's tag leaves the board before any end of the hold is returned
(tests/plan/test_leases.py); here the reader's one-sided checks must see
that: a read of a held request passes; a read after the hold ended
(released, consumed) is checked before its data READ and copies nothing; a
hold that ends between that check and the copy fails the read as stale
after it, with every such rank's blocks invalid; checks that wait for a
free slot still end. A handshake's probe reads each
holder's board once, waits for a free slot like a check, and fails once its
connection is released under it.
"""

import dataclasses
import os
import time

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError, TransferError
from kvxferd.plan.notifications import HELLO
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.nixl.checks import NUM_CHECK_SLOTS
from kvxferd.xfer.holder import NoticeEvent
from kvxferd.xfer.handles import ReadFailure
from kvxferd.rig.reading import post, wait, wait_all


@pytest.fixture(scope="module", params=["nixl", "same-host", "nixl-tcp"])
def cluster(request):
    """Every rule below holds whether a rank's data comes over NIXL or is copied same-host (issue #37), and
    over UCX's tcp transport alone (issue #58: READs emulated with messages the holder answers, as between
    hosts without RDMA; the holder's thread sleeps on its agent's sockets)."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    same_host = request.param == "same-host"
    saved = {name: os.environ.get(name) for name in ("UCX_TLS", "UCX_NET_DEVICES")}
    if request.param == "nixl-tcp":  # read when each agent is made
        os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    try:
        with LocalCluster(prefill_groups, decode_groups, 2, 1, name=f"board-{request.param}",
                          same_host=same_host) as cluster:
            if request.param == "nixl-tcp":
                assert all(holder.agent.wake_fds for holder in cluster.holders), "its sockets' sets were found"
            yield cluster
            assert (cluster.executors[0].num_host_copies > 0) == same_host  # the path named was the path taken
            if request.param == "nixl-tcp":
                assert cluster.holder_thread.num_woken > 0, "the holders' sockets woke their thread"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _request(cluster, request_id: str, seed: int):
    return random_request(request_id, cluster.prefill_groups, cluster.decode_groups, 48, np.random.default_rng(seed))


def _every_rank_stale(cluster, result, request, error: str = "stale read") -> None:
    assert not result.ok and result.failure is ReadFailure.STALE and error in result.error
    read_ranks = tuple(r.remote_rank for r in cluster.executors[0].remote(cluster.prefill_id).plan.plan_request(request).reads)
    assert result.failed_ranks == read_ranks and result.num_bytes == 0
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)


def test_a_held_read_passes_and_an_unheld_one_moves_nothing(cluster):
    """Issue 35: a never-held request id used to be read and only then found stale (its bytes already in the
    reader's cache); without its holders' capabilities it is refused before anything is posted."""
    held = _request(cluster, "held", 1)
    cluster.reset_decode()
    (result,) = cluster.read(held)
    assert result.ok and cluster.check(held) == [] and not cluster.decode_untouched()  # (the check can fail)
    for q in range(2):
        assert cluster.holder_thread.wait_end(q, held.remote_request_id).kind == "CONSUMED"
    cluster.reset_decode()
    never = _request(cluster, "never-held", 2)
    with pytest.raises(PermissionDeniedError) as err:
        cluster.read(never, hold=False)
    assert err.value.field == "remote_capabilities"
    forged = dataclasses.replace(never, remote_capabilities=cluster.capabilities[held.remote_request_id])
    with pytest.raises(PermissionDeniedError) as err:  # another hold's capabilities
        cluster.read(forged, hold=False)
    assert err.value.field == "remote_capabilities[0]"
    assert cluster.decode_untouched()


def test_a_released_or_consumed_hold_is_not_read(cluster):
    """Issue 35: a read that carries its hold's capabilities but comes after the hold ended (released,
    consumed: a replay) was posted and its bytes copied before the board said stale. Now the board is read
    first, and a rank whose hold is gone copies nothing."""
    request = cluster.hold(_request(cluster, "released", 3), 60)
    with cluster.holders[1].lock:
        cluster.holders[1].holds.release(request.remote_request_id)
    (result,) = cluster.read(request, hold=False)
    assert not result.ok and result.failure is ReadFailure.STALE and result.failed_ranks == (1,)
    assert "nothing copied" in result.error
    # Rank 0 still held it: it hears that the read failed and ends the hold (its only reader reported).
    end = cluster.holder_thread.wait_end(0, request.remote_request_id)
    assert end.kind == "CONSUMED" and end.failed_readers == ((cluster.decode_id, 0),)
    # Rank 1 gets no notice: its hold had ended, and a notice could only count for a later hold of the id.
    cluster.holders[1].hold(request.remote_request_id, request.remote_block_ids, 60)  # (a new key would not do)
    assert cluster.holder_thread.wait_end(1, request.remote_request_id, timeout_s=0.3) is None
    assert cluster.holders[1].counts[NoticeEvent.LATE] == 0
    with cluster.holders[1].lock:
        cluster.holders[1].holds.release(request.remote_request_id)
    consumed = _request(cluster, "consumed", 4)
    assert cluster.read(consumed)[0].ok
    assert all(cluster.holder_thread.wait_end(q, consumed.remote_request_id).kind == "CONSUMED" for q in range(2))
    cluster.reset_decode()
    (again,) = cluster.read(consumed, hold=False)  # the same request read again after it was consumed
    _every_rank_stale(cluster, again, consumed, "nothing copied")
    assert cluster.decode_untouched()
    # Negative control: the same read while held writes the decode cache (decode_untouched can fail).
    cluster.hold(consumed, 60)
    assert cluster.read(consumed, hold=False)[0].ok and not cluster.decode_untouched()


def test_a_hold_that_ends_during_the_copy_fails_the_read_as_stale(cluster, monkeypatch):
    """The board is read again after the data: a hold released between the first check and the copy (the
    holder may reuse the blocks meanwhile) leaves the read failed, every rank's blocks invalid."""
    executor = cluster.executors[0]
    request = cluster.hold(_request(cluster, "ends-during", 5), 60)
    move = executor.mover.move

    def release_then_read(remote, q, rank_read):
        holder = cluster.holders[q]
        with holder.lock:
            holder.holds.release(request.remote_request_id)
        return move(remote, q, rank_read)

    monkeypatch.setattr(executor.mover, "move", release_then_read)
    (result,) = cluster.read(request, hold=False)
    _every_rank_stale(cluster, result, request)


def test_checks_wait_for_a_free_slot_and_all_end(cluster):
    """One free check slot for eight reads of two ranks each: every check still runs, one after another.
    The reads are polled together, as the data plane polls them: over TCP a later read's check can take
    the slot inside its post, and holds it until that read is polled (a wait for the first read alone
    would wait forever: the 10 s stalls once seen here, issue #58)."""
    executor = cluster.executors[0]
    checks = executor.checks
    taken = [checks._free.pop() for _ in range(checks.num_free - 1)]
    try:
        requests = [cluster.hold(_request(cluster, f"queued-{n}", 10 + n), 60) for n in range(8)]
        inflight = [post(executor, cluster.prefill_id, request) for request in requests]
        results = wait_all(executor, inflight, 10)
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


def _probe_until_done(executor, remote, timeout_s: float = 10.0):
    deadline = time.perf_counter() + timeout_s
    while (errors := executor.poll_probe(remote)) is None:
        assert time.perf_counter() < deadline, "the probe did not end"
        time.sleep(1e-3)
    return errors


def test_a_probe_reads_every_holders_board_and_gives_its_slots_back(cluster):
    executor = cluster.executors[0]
    remote = executor.remote(cluster.prefill_id)
    probe = executor.start_probe(remote)
    assert not probe.waiting  # both READs posted (here in process they may already have ended)
    assert _probe_until_done(executor, remote) == {}
    assert remote.probe is None and executor.checks.num_free == NUM_CHECK_SLOTS


def test_a_probe_waits_for_a_free_check_slot(cluster):
    executor = cluster.executors[0]
    remote = executor.remote(cluster.prefill_id)
    taken = [executor.checks._free.pop() for _ in range(executor.checks.num_free)]
    try:
        probe = executor.start_probe(remote)
        assert sorted(probe.waiting) == [0, 1] and executor.poll_probe(remote) is None
    finally:
        executor.checks._free.extend(taken)
    assert _probe_until_done(executor, remote) == {}
    assert executor.checks.num_free == NUM_CHECK_SLOTS


def test_a_connection_released_under_its_probe_fails_the_probe(cluster):
    """A re-handshake or a deregistration releases the lists under a running probe: its READs are
    released first, their slots come back, and whoever polls it learns that it is gone."""
    executor = cluster.executors[0]
    remote = executor.remote(cluster.prefill_id)
    executor.start_probe(remote)
    try:
        executor.disconnect(cluster.prefill_id)
        # Each slot is free, or (its READ still running: UCX cannot stop it) quarantined until it ends.
        checks = executor.checks
        assert checks.num_free + len(checks._quarantine) == NUM_CHECK_SLOTS
        deadline = time.perf_counter() + 10
        while checks._quarantine and time.perf_counter() < deadline:
            checks._reclaim()
            time.sleep(1e-3)
        assert checks.num_free == NUM_CHECK_SLOTS
        with pytest.raises(TransferError, match="released while it was probed"):
            executor.poll_probe(remote)
    finally:
        cluster.connect()
    assert cluster.read(_request(cluster, "after-probe", 31))[0].ok


def test_the_probes_hello_reaches_every_holder_and_counts_for_nothing(cluster, monkeypatch):
    executor = cluster.executors[0]
    heard = []
    for q, holder in enumerate(cluster.holders):
        real = holder.on_notice
        monkeypatch.setattr(holder, "on_notice", lambda sender, message, real=real, q=q:
                            heard.append((q, sender, bytes(message))) or real(sender, message))
    before = [(holder.counts[NoticeEvent.BAD], holder.counts[NoticeEvent.FOREIGN]) for holder in cluster.holders]
    executor.start_probe(executor.remote(cluster.prefill_id))
    assert _probe_until_done(executor, executor.remote(cluster.prefill_id)) == {}
    deadline = time.perf_counter() + 5
    while sum(h[2] == HELLO for h in heard) < 2 and time.perf_counter() < deadline:
        time.sleep(1e-3)
    time.sleep(0.05)  # and nothing else of ours comes (earlier tests' notices may still arrive)
    assert sorted(h for h in heard if h[2] == HELLO) == [(0, executor.notices.name, HELLO), (1, executor.notices.name, HELLO)]
    # Ignored from anyone: not a malformed notice, not a foreign one, and it ends nothing.
    assert cluster.holders[0].on_notice("some-other-agent", HELLO) == []
    assert [(holder.counts[NoticeEvent.BAD], holder.counts[NoticeEvent.FOREIGN]) for holder in cluster.holders] == before


def test_one_remote_engine_takes_at_most_its_share_of_check_slots(cluster):
    """Issue 35 review: every read now takes a check slot before its data moves, so reads to a holder that stopped
    answering (checks waiting for their deadlines) could take every slot and stall reads to other holders. One
    remote engine holds at most ``max_per_owner`` slots; other owners still get theirs."""
    executor = cluster.executors[0]
    checks, remote = executor.checks, executor.remote(cluster.prefill_id)
    assert checks.max_per_owner == NUM_CHECK_SLOTS // 4
    board, buckets = remote.board_lists[0], remote.board_buckets[0]
    checks.max_per_owner = 2
    posted = []
    try:
        posted += [checks.post(board, buckets, 1, "stalled") for _ in range(2)]
        assert all(posted) and checks.post(board, buckets, 1, "stalled") is None  # its share is taken
        posted.append(checks.post(board, buckets, 1, "healthy"))  # another remote engine is not held up
        assert posted[-1] is not None
        first, _state = posted.pop(0)
        checks.end(first.handle, first.slot)
        posted.append(checks.post(board, buckets, 1, "stalled"))  # a slot of its own came back
        assert posted[-1] is not None
        # Reads of one remote engine beyond its share wait for their own slots and all end.
        requests = [cluster.hold(_request(cluster, f"share-{n}", 40 + n), 60) for n in range(6)]
        results = [wait(executor, post(executor, cluster.prefill_id, r), 10) for r in requests]
        assert [r.error for r in results] == [None] * 6
    finally:
        for check, _state in posted:
            checks.end(check.handle, check.slot)
        checks.max_per_owner = NUM_CHECK_SLOTS // 4
    assert checks.num_free == NUM_CHECK_SLOTS and not checks._num_owned
