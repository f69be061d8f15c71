"""Push over real NIXL (issue #57): prefill ranks WRITE into the blocks decode ranks expect, byte-exact.

The mirror of ``test_matrix.py``: each case runs a prefill and a decode engine with one NIXL agent
per rank (UCX, loopback, host memory); decode ranks expect two requests in turn (a full one, then a
prefix-cache hit with a sliding window and scattered ids), prefill ranks push them, every decode
byte is checked against the oracle and every expectation must end CONSUMED.
"""

import numpy as np
import pytest

from kvxferd.errors import NotFoundError
from kvxferd.plan.leases import HoldEndKind
from kvxferd.plan.push import PushRequest
from kvxferd.rig.verify.models import MODELS, model_groups, random_request
from kvxferd.rig.verify.pushcluster import PushCluster
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.holder import NoticeEvent

from tests.sampling import covering
from tests.xfer.test_matrix import SHAPES, TP_PAIRS


@pytest.mark.parametrize("pair, model, shape, same_host", covering(
    TP_PAIRS, MODELS, list(SHAPES), [False, True],
    ids=lambda pair, model, shape, same_host: f"P{pair[0]}D{pair[1]}-{model}-{shape}-{'copy' if same_host else 'nixl'}"))
def test_pushes_are_byte_exact(pair, model, shape, same_host):
    """Over NIXL WRITEs, and (``same_host``) by copies into the decode engine's shared memory mapped by each
    prefill rank; every write of the same-host runs is a copy, none of the others'."""
    p, d = pair
    prefill_groups, decode_groups = model_groups(model, SHAPES[shape])
    rng = np.random.default_rng(p * 10 + d)
    requests = [random_request("full", prefill_groups, decode_groups, 70, rng),
                random_request("hit", prefill_groups, decode_groups, 90, rng, cached_tokens=32, window_tokens=24,
                               contiguous=False)]
    with PushCluster(prefill_groups, decode_groups, p, d, name=f"push-{model}-{shape}-{p}-{d}-{same_host}",
                     same_host=same_host) as cluster:
        num_writes = 0
        for request in requests:
            cluster.reset_decode()
            results = cluster.push(request, cluster.expect(request))
            assert [r.error for r in results if not r.ok] == []
            num_writes += sum(bool(r.num_descriptors) for r in results)
            for r in range(d):
                end = cluster.holder_thread.wait_end(r, request.remote_request_id, timeout_s=10)
                assert end is not None and end.kind is HoldEndKind.CONSUMED and not end.failed_readers, f"decode {r}: {end}"
            assert cluster.check(request) == []
        counts = [(h.counts[NoticeEvent.BAD], h.counts[NoticeEvent.FOREIGN], h.counts[NoticeEvent.LATE],
                   h.counts[NoticeEvent.UNSEALED]) for h in cluster.expectations]
        assert counts == [(0, 0, 0, 0)] * d
        copies = sum(pusher.machine.mover.num_host_copies for pusher in cluster.pushers)
        assert num_writes and copies == (num_writes if same_host else 0)


def cluster_and_request(name, p=2, d=2, model="gqa", same_host=False):
    prefill_groups, decode_groups = model_groups(model, SHAPES["blocks_32_to_16"])
    request = random_request("r", prefill_groups, decode_groups, 70, np.random.default_rng(3))
    return PushCluster(prefill_groups, decode_groups, p, d, name=f"{name}-{same_host}", same_host=same_host), request


WAYS = pytest.mark.parametrize("same_host", [False, True], ids=["nixl", "copy"])


@WAYS
def test_a_push_into_an_expectation_that_ended_writes_nothing(same_host):
    """The decode side released its expectation (an abort): every writer finds no tag on the board (read over
    NIXL, or mapped here with the target's memory) and writes nothing; no expectation is consumed."""
    cluster, request = cluster_and_request("push-released", same_host=same_host)
    with cluster:
        if same_host:  # the control of the way: mapped memory, and a mapped board (its checks are loads)
            assert all(t.host_ranks[d].board is not None for p in cluster.pushers for (_, _, d), t in p.targets.items())
        cluster.reset_decode()
        capabilities = cluster.expect(request)
        for holder in cluster.expectations:
            with holder.lock:
                holder.holds.release(request.remote_request_id)
        results = cluster.push(request, capabilities)
        assert results and all(not r.ok and r.failure is ReadFailure.STALE for r in results if r.num_descriptors)
        assert cluster.decode_untouched()
        assert cluster.holder_thread.wait_end(0, request.remote_request_id, timeout_s=0.5) is None


@WAYS
def test_a_push_sealed_by_another_capability_is_refused_and_writes_nothing(same_host):
    """A capability the decode rank never minted (another transfer's, or made up) has no tag on its board:
    nothing is written, and its notice counts for nothing."""
    cluster, request = cluster_and_request("push-forged", same_host=same_host)
    with cluster:
        cluster.reset_decode()
        cluster.expect(request)
        if same_host:  # the control of the way: mapped memory, and a mapped board (its checks are loads)
            assert all(t.host_ranks[d].board is not None for p in cluster.pushers for (_, _, d), t in p.targets.items())
        forged = tuple(bytes(16) for _ in cluster.expectations)
        results = cluster.push(request, forged)
        assert all(not r.ok and r.failure is ReadFailure.STALE for r in results if r.num_descriptors)
        assert cluster.decode_untouched()


@WAYS
def test_a_push_of_another_prompts_kv_is_caught_by_the_oracle(same_host):
    """Negative control of the byte check: the writers push other prefill blocks into the expected ones."""
    cluster, request = cluster_and_request("push-other", p=1, d=1, same_host=same_host)
    other = random_request("o", cluster.prefill_groups, cluster.decode_groups, 70, np.random.default_rng(9))
    with cluster:
        cluster.reset_decode()
        capabilities = cluster.expect(request)
        swapped = type(request)(request.request_id, request.remote_request_id, request.local_block_ids,
                                other.remote_block_ids, request.num_tokens)
        assert all(r.ok for r in cluster.push(swapped, capabilities))
        assert cluster.check(request) != []
        assert cluster.pushers[0].machine.mover.num_host_copies == (1 if same_host else 0)


def test_a_failed_writer_is_named_when_the_expectation_ends():
    """A writer whose WRITE failed notifies failed: the expectation ends naming it among the failed
    writers, so the decode side fails the transfer (the engine recomputes) instead of completing it.

    The WRITE fails for real and every time: its board check passes, then NIXL refuses to make a WRITE
    of descriptors past the target's prepared list. (Aborting a posted push raced: over shared memory
    the check and the WRITE may both end inside the post, and the push was then ok.)"""
    cluster, request = cluster_and_request("push-failed", p=1, d=1)
    with cluster:
        capabilities = cluster.expect(request)
        pusher = cluster.pushers[0]
        target = pusher.target(cluster.decode_id, 0)
        push = PushRequest(request.remote_request_id, request.local_block_ids, request.remote_block_ids,
                           capabilities[0], request.num_tokens)
        planned = pusher.plan(target, 0, push)
        planned.write.remote_ids[:] = np.iinfo(np.int32).max  # no such descriptor on the target
        inflight = pusher.post(target, planned)
        result = pusher.poll(inflight)
        while result is None:
            result = pusher.poll(inflight)
        assert not result.ok and result.failure is ReadFailure.TRANSFER, result
        assert cluster.decode_untouched()
        pusher.send_notice(inflight, 0)
        end = cluster.holder_thread.wait_end(0, request.remote_request_id, timeout_s=10)
        assert end is not None and end.failed_readers == ((cluster.prefill_id, 0),)


def test_an_expectation_counts_only_from_the_agent_introduced_for_its_decode_rank():
    """The holder side of a push: an expectation from any other agent is dropped (FOREIGN), bytes that are
    not one are BAD, and the introduced agent's is taken."""
    from kvxferd.plan.expectrecord import ExpectRecord
    from kvxferd.xfer.holder import Holder, Reader
    from kvxferd.xfer.nixl.agent import NixlAgent

    agent = NixlAgent("expect-holder")
    holder = Holder(agent)
    try:
        holder.introduce(("decode", 0), Reader("decode-notices", 1, 1))
        record = ExpectRecord("t", "decode", 0, (np.array([1]),), bytes(16), 5.0, bytes(16)).encode()
        assert holder.expectation("intruder", record) is None and holder.counts[NoticeEvent.FOREIGN] == 1
        assert holder.expectation("decode-notices", b"KE\x01garbage") is None and holder.counts[NoticeEvent.BAD] == 1
        taken, identity = holder.expectation("decode-notices", record)
        assert taken.transfer_id == "t" and identity == ""
    finally:
        holder.close()
        agent.close()


def test_push_connections_are_kept_per_owner():
    """Push targets are per (peer identity, engine, rank): another identity naming the same decode rank
    gets a connection of its own and cannot replace the first (its pushes go on); the same owner again
    replaces its own; a disconnected owner's connection goes, the others stay."""
    cluster, request = cluster_and_request("push-owners", p=1, d=1)
    with cluster:
        pusher = cluster.pushers[0]
        first = pusher.target(cluster.decode_id, 0)
        decode = cluster.decode[0]
        other = pusher.connect(decode.cache, cluster.decode_agents[0].metadata(), cluster.expectations[0].board,
                               "another-identity")
        assert other is not first and pusher.target(cluster.decode_id, 0) is first
        assert pusher.target(cluster.decode_id, 0, "another-identity") is other
        pusher.disconnect(("another-identity", cluster.decode_id, 0))
        assert pusher.target(cluster.decode_id, 0) is first
        with pytest.raises(NotFoundError):
            pusher.target(cluster.decode_id, 0, "another-identity")
        capabilities = cluster.expect(request)
        assert all(r.ok for r in cluster.push(request, capabilities))  # the first owner's connection still writes
        assert cluster.check(request) == []
