"""A failure fails its request only: status, invalid block ids, others go on."""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from kvxferd.errors import BlockIdError, NotFoundError
from kvxferd.plan.engine import ReadRequest
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.nixl.agent import NixlAgent, TransferState
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.xfer.reads import UNSETTLED_ERROR, ReadExecutor
from kvxferd.xfer.handles import ReadFailure, TransferFailure
from kvxferd.xfer.admission import admit
from kvxferd.xfer.rankstate import RankPhase, RankTransfer
from kvxferd.xfer.records import InFlightRead, ReadTimes
from kvxferd.rig.reading import post, read, wait

PREFILL_GROUPS, DECODE_GROUPS = model_groups("hybrid", ModelShape(num_layers=2))


class Prefill:
    """One in-process prefill engine (TP 2) with its agents."""

    def __init__(self, name):
        self.engines = [allocate_engine(name, PREFILL_GROUPS, 2, q, tagged=True) for q in range(2)]
        self.agents = [NixlAgent(f"{name}-{q}") for q in range(2)]
        for agent, engine in zip(self.agents, self.engines):
            agent.register(engine.cache)

    @property
    def caches(self):
        return [e.cache for e in self.engines]

    def metadata(self):
        return [a.metadata() for a in self.agents]


@pytest.fixture
def world():
    healthy, broken = Prefill("healthy"), Prefill("broken")
    decode = allocate_engine("decode", DECODE_GROUPS, 1, 0, tagged=False)
    executor = ReadExecutor(NixlAgent("decode-0"), decode.cache)
    pump = HolderThread(healthy.agents + broken.agents + [executor.agent]).__enter__()
    for prefill in (healthy, broken):
        executor.connect(prefill.caches, prefill.metadata())
    yield healthy, broken, decode, executor, pump
    pump.stop()
    for engine_id in ("healthy", "broken"):
        executor.disconnect(engine_id)


def check_ignoring(decode, request, ignore):
    """Oracle check of ``request``; blocks of the failed ``ignore`` request may hold anything."""
    expected = expected_buffers(decode.cache, PREFILL_GROUPS, request)
    for g, ids in enumerate(ignore.local_block_ids):
        for region in range(DECODE_GROUPS[g].num_regions):
            # Both decode layouts here are block-major: a block is one row.
            view = decode.buffers[g][region].reshape(DECODE_GROUPS[g].spec.num_blocks, -1)
            view[ids] = expected[g][region].reshape(view.shape)[ids]
    return check_buffers(decode, expected)


def two_requests(rng):
    one = random_request("one", PREFILL_GROUPS, DECODE_GROUPS, 50, rng)
    # The second request writes other decode blocks than the first.
    used = [set(ids.tolist()) for ids in one.local_block_ids]
    free = [np.array([b for b in range(g.spec.num_blocks) if b not in u]) for g, u in zip(DECODE_GROUPS, used)]
    two = ReadRequest("two", "two@prefill", tuple(f[: len(ids)] for f, ids in zip(free, one.local_block_ids)),
                      one.remote_block_ids, one.num_tokens)
    return one, two


def test_removed_remote_agent_fails_only_its_request(world):
    healthy, broken, decode, executor, pump = world
    one, two = two_requests(np.random.default_rng(1))
    remote = executor.remote("broken")
    executor.agent.remove_remote(remote.agent_names[1])  # rank 1 of "broken" vanishes after the handshake
    bad = post(executor, "broken", one)  # rank 0's part is read, rank 1's fails
    good = post(executor, "healthy", two)
    bad, good = wait(executor, bad), wait(executor, good)
    assert not bad.ok and bad.failed_ranks == (1,) and "make_prepped_xfer" in bad.error
    assert [ids.tolist() for ids in bad.invalid_block_ids] == [sorted(ids.tolist()) for ids in one.local_block_ids]
    assert good.ok and good.num_bytes > 0
    assert check_ignoring(decode, two, ignore=one) == []
    # A new handshake with the peer brings the engine back.
    executor.connect(broken.caches, broken.metadata())
    assert read(executor, "broken", one).ok


def test_invalid_block_id_is_refused_before_posting(world):
    healthy, _, decode, executor, pump = world
    one, two = two_requests(np.random.default_rng(2))
    bad = ReadRequest("bad", "bad@prefill", one.local_block_ids,
                      (np.array([10_000]),) + tuple(one.remote_block_ids[1:]), one.num_tokens)
    with pytest.raises(BlockIdError) as err:
        post(executor, "healthy", bad)
    assert err.value.field == "groups[0].remote_block_ids[0]"
    with pytest.raises(NotFoundError):
        post(executor, "nobody", one)
    assert read(executor, "healthy", one).ok
    assert check_buffers(decode, expected_buffers(decode.cache, PREFILL_GROUPS, one)) == []


def _prefill_child(conn):
    engine = allocate_engine("doomed", PREFILL_GROUPS, 1, 0, tagged=True)
    agent = NixlAgent("doomed-0")
    agent.register(engine.cache)
    conn.send((engine.cache, agent.metadata()))
    with HolderThread([agent]):
        conn.recv()  # killed before this returns


def test_dead_peer_makes_the_transfer_report_an_error(world):
    healthy, _, decode, executor, pump = world
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_prefill_child, args=(child,), daemon=True)
    process.start()
    try:
        cache, metadata = parent.recv()
        executor.connect([cache], [metadata])
        one, two = two_requests(np.random.default_rng(3))
        assert read(executor, "doomed", one).ok  # alive: works
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        failed = read(executor, "doomed", two, timeout_s=10)
        good = read(executor, "healthy", one)
    finally:
        process.kill()
    assert not failed.ok and failed.failed_ranks == (0,)
    assert "RemoteDisconnect" in failed.error
    assert [ids.tolist() for ids in failed.invalid_block_ids] == [sorted(ids.tolist()) for ids in two.local_block_ids]
    assert good.ok
    assert check_ignoring(decode, one, ignore=two) == []
    executor.disconnect("doomed")


def test_a_closed_agent_refuses_calls_with_a_typed_error():
    from kvxferd.errors import UnavailableError

    agent = NixlAgent("closed-0")
    agent.close()
    with pytest.raises(UnavailableError, match="closed"):
        agent.metadata()
    agent.close()  # twice is fine


def test_past_the_drain_deadline_the_result_says_its_blocks_may_be_written(world):
    """UCX cannot stop a READ: an aborted read's result waits while NIXL says a transfer of it runs, and past
    abort_drain_s it says its blocks may still be written (the real late write over a partitioned link:
    tests/rig/verify/hosts/test_late_writes.py)."""
    healthy, _, decode, executor, _ = world
    executor.abort_drain_s = 0.2
    inflight = _unposted(executor, "stuck")
    released = []
    fake = StandInTransfer(lambda: True, released)  # a transfer that never ends: released when the drain gives up
    _running(inflight, fake)
    assert executor.abort(inflight, "deadline: test") is None
    assert executor.poll(inflight) is None and not released
    time.sleep(0.25)
    result = executor.poll(inflight)
    assert result is not None and not result.ok and UNSETTLED_ERROR in result.error and fake in released
    assert sum(len(ids) for ids in result.invalid_block_ids) > 0  # rank 0's blocks are named


def test_an_abort_without_drain_releases_at_once(world):
    healthy, _, decode, executor, _ = world
    inflight = _unposted(executor, "at-once")
    released = []
    _running(inflight, marker := StandInTransfer(lambda: True, released))
    result = executor.abort(inflight, "the engine went away", drain=False)
    assert result is not None and not result.ok and marker in released and UNSETTLED_ERROR not in result.error


def _draining_read(executor, request_id, running):
    """A read of ``healthy`` aborted while a (stand-in) transfer of it still runs: NIXL says so while
    ``running["yes"]``."""
    released = []
    inflight = _unposted(executor, request_id)
    _running(inflight, marker := StandInTransfer(lambda: running["yes"], released))
    return inflight, marker, released


class StandInTransfer:
    """A rank's transfer (xfer/handles.py's TransferHandle) that runs while ``running()`` says so and
    records its release."""

    lands_in_blocks = True

    def __init__(self, running, released: list) -> None:
        self.running, self.released = running, released

    def state(self) -> TransferState:
        return TransferState.PROC if self.running() else TransferState.DONE

    def failure(self) -> TransferFailure:
        return TransferFailure("stand-in", ReadFailure.TRANSFER)

    def release(self) -> None:
        self.released.append(self)


def _unposted(executor, request_id):
    """A read of ``healthy`` planned but never posted: its transfers are the stand-ins a test puts in."""
    request = random_request(request_id, PREFILL_GROUPS, DECODE_GROUPS, 50, np.random.default_rng(8))
    admitted = admit(executor.remote("healthy"), request)
    ranks = {r.remote_rank: RankTransfer(r, 0) for r in admitted.planned.reads}
    return InFlightRead(admitted, ranks, ReadTimes(time.perf_counter()))


def _running(inflight, transfer):
    """Rank 0's data is on its way, as ``transfer``."""
    inflight.ranks[0].enter(RankPhase.MOVING, transfer)


def test_an_aborted_read_ends_once_its_transfer_did_without_saying_unsettled(world):
    _, _, _, executor, _ = world
    running = {"yes": True}
    executor.abort_drain_s = 60.0
    inflight, marker, released = _draining_read(executor, "drains", running)
    assert executor.abort(inflight, "deadline: test") is None
    assert executor.abort(inflight, "deadline: again") is None  # idempotent while it drains
    assert inflight.remote.num_draining == 1 and executor.poll(inflight) is None and not released
    running["yes"] = False
    result = executor.poll(inflight)
    assert result is not None and not result.ok and "deadline: test" in result.error
    assert UNSETTLED_ERROR not in result.error and not result.unsettled and released == [marker]
    assert inflight.remote.num_draining == 0


def test_a_replaced_connection_stays_loaded_until_its_aborted_reads_drained(world):
    """A re-handshake must not release the lists and remote agents a running transfer still uses."""
    _, _, _, executor, _ = world
    running = {"yes": True}
    inflight, _, _ = _draining_read(executor, "retired", running)
    remote = inflight.remote
    assert executor.abort(inflight, "the remote engine was re-handshaked") is None
    executor.disconnect("healthy")
    assert remote in executor.connections.retired and remote.local_lists  # kept: the transfer may still run
    running["yes"] = False
    assert executor.poll(inflight) is not None
    assert not remote.local_lists and not remote.remote_lists  # released once it ended


def test_an_abandoned_check_keeps_its_slot_until_its_read_ended(world, monkeypatch):
    from kvxferd.xfer.nixl.agent import TransferState

    _, _, _, executor, _ = world
    area = executor.checks
    state = {"now": TransferState.PROC}
    monkeypatch.setattr(area.agent, "state", lambda handle: state["now"])
    monkeypatch.setattr(area, "_release", lambda handle: None)
    num_free = area.num_free
    slot = area._free.pop()  # as a posted check holds it
    area.end(object(), slot, maybe_running=True)
    area._reclaim()
    assert area.num_free == num_free - 1  # its READ may still land there
    state["now"] = TransferState.DONE
    area._reclaim()
    assert area.num_free == num_free
