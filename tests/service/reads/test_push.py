"""Push through real daemons (issue #57): decode daemons expect, prefill daemons WRITE, every byte checked.

One ``kvxferd serve`` per TP rank, real NIXL, gRPC and ZMQ. A decode rank's push ``ReadSpec`` becomes an
expectation (a hold of its blocks on its own board) that its daemon sends to every prefill daemon it
needs (``Expect``); a prefill daemon writes once its engine holds the transfer, whichever came first;
the decode completion comes when every writer notified; the prefill hold ends CONSUMED on the bus.
"""

import time

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request

CASES = [("gqa", 2, 1), ("gqa", 1, 2), ("mla", 2, 1), ("hybrid", 2, 1), ("swa", 3, 2)]


@pytest.mark.parametrize("model,prefill_tp,decode_tp", CASES, ids=[f"{m}-P{p}D{d}" for m, p, d in CASES])
def test_pushes_through_daemons_are_byte_exact(workdir, model, prefill_tp, decode_tp):
    prefill_groups, decode_groups = model_groups(model, ModelShape(prefill_block_size=32))
    rng = np.random.default_rng(11)
    requests = [(random_request("early", prefill_groups, decode_groups, 70, rng), True),
                (random_request("late", prefill_groups, decode_groups, 90, rng, cached_tokens=32, contiguous=False),
                 False)]
    with DaemonCluster(prefill_groups, decode_groups, prefill_tp, decode_tp, workdir=workdir,
                       name=f"push-{model}") as cluster:
        for request, hold_first in requests:  # the prefill hold before the expectations, then after them
            cluster.reset_decode()
            completions = cluster.push(request, hold_first=hold_first)
            assert [(c.ok, c.error) for c in completions] == [(True, "")] * decode_tp
            problems, wrong = cluster.verify(request)
            assert not problems and wrong == 0
            events = cluster.hold_events(request)
            assert [e.kind for e in events] == [pb.NotifyEvent.CONSUMED] * prefill_tp
        for subscriber in cluster.subscribers:  # exactly one end per hold: nothing else was published
            assert subscriber.next(timeout_s=0.3) is None and subscriber.last_seq == len(requests)


def small_cluster(workdir, name, **kwargs):
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    cluster = DaemonCluster(prefill_groups, decode_groups, 2, 1, workdir=workdir, name=name, **kwargs)
    return cluster, np.random.default_rng(5)


def test_a_push_whose_prefill_never_holds_fails_at_its_deadline_writing_nothing(workdir):
    cluster, rng = small_cluster(workdir, "push-deadline")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        start = time.monotonic()
        for client in cluster.decode_clients:
            client.submit_push(request.request_id, cluster.prefill_id, request.remote_request_id,
                               request.local_block_ids, num_tokens=70, deadline_s=0.5)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok and "deadline" in completion.error
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]
        assert time.monotonic() - start >= 0.5
        # The prefill engine holds it only now: its daemons forgot the expectation, nothing is written.
        cluster.hold(request)
        time.sleep(0.3)
        assert cluster.decode_untouched()


def test_a_push_the_decode_engine_released_is_failed_and_never_written(workdir):
    """An abort on the decode side: the engine releases the transfer id (its expectation). The prefill
    daemons' writes that come with the later hold find no expectation on the decode board and write
    nothing; the prefill holds end at once (FAILED for the decode rank, then CONSUMED: nobody else will
    read them), not by their lease."""
    cluster, rng = small_cluster(workdir, "push-abort")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        for client in cluster.decode_clients:
            client.submit_push(request.request_id, cluster.prefill_id, request.remote_request_id,
                               request.local_block_ids, num_tokens=70, deadline_s=20)
        time.sleep(0.2)  # the expectations reached the prefill daemons
        for client in cluster.decode_clients:
            client.release(request.remote_request_id)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok and "released" in completion.error
        cluster.hold(request, lease_s=30.0)
        failed = [s.wait_for(request.remote_request_id, kinds=(pb.NotifyEvent.FAILED,), timeout_s=10)
                  for s in cluster.subscribers]
        assert all(e is not None and "push" in e.reason for e in failed)
        assert [e.kind for e in cluster.hold_events(request, timeout_s=10)] == [pb.NotifyEvent.CONSUMED] * 2
        assert cluster.decode_untouched()


def test_a_push_of_another_prompts_kv_is_caught_by_the_oracle(workdir):
    """Negative control of the byte check: the prefill engine holds other blocks under the transfer id, so
    the daemons push that KV (the completion is ok: they wrote what was held) and the oracle sees it."""
    cluster, rng = small_cluster(workdir, "push-other")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        other = random_request("o", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        for client in cluster.decode_clients:
            client.submit_push(request.request_id, cluster.prefill_id, request.remote_request_id,
                               request.local_block_ids, num_tokens=70)
        for client in cluster.prefill_clients:
            client.hold(request.remote_request_id, other.remote_block_ids)
        assert all(c.ok for c in cluster.completions(request))
        assert cluster.verify(request)[1] > 0


def test_bad_pushes_are_refused_as_completions_with_nothing_written(workdir):
    cluster, rng = small_cluster(workdir, "push-bad")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        (client,) = cluster.decode_clients
        cluster.reset_decode()
        spec = client.read_spec("with-ids", cluster.prefill_id, "t1", request.local_block_ids, request.remote_block_ids)
        spec.push = True
        out_of_range = client.read_spec("far", cluster.prefill_id, "t2", (np.array([10**6]),), ((),))
        out_of_range.push = True
        unknown = client.read_spec("unknown", "nobody", "t3", request.local_block_ids, ((),))
        unknown.push = True
        client.reads.submit_reads([spec, out_of_range, unknown])
        refused = {r: client.reads.wait_completion(r, 10) for r in ("with-ids", "far", "unknown")}
        assert {r: (c.ok, c.refused_code) for r, c in refused.items()} == {
            "with-ids": (False, 3), "far": (False, 3), "unknown": (False, 5)}  # INVALID_ARGUMENT, NOT_FOUND
        # A transfer id expected twice at once: the second is refused, the first goes on.
        client.submit_push("first", cluster.prefill_id, "t4", request.local_block_ids, num_tokens=70)
        client.submit_push("second", cluster.prefill_id, "t4", request.local_block_ids, num_tokens=70)
        second = client.reads.wait_completion("second", 10)
        assert not second.ok and second.refused_code == 3 and "already held" in second.error
        # Another transfer naming blocks a live expectation names (another request's): refused, nothing held.
        client.submit_push("overlap", cluster.prefill_id, "t5", request.local_block_ids, num_tokens=70)
        overlap = client.reads.wait_completion("overlap", 10)
        assert not overlap.ok and overlap.refused_code == 3 and "expected by another push" in overlap.error
        for prefill in cluster.prefill_clients:
            prefill.hold("t4", request.remote_block_ids)
        assert client.reads.wait_completion("first", 10).ok
        # Once it completed, its blocks may be expected again.
        client.submit_push("again", cluster.prefill_id, "t6", request.local_block_ids, num_tokens=70)
        for prefill in cluster.prefill_clients:
            prefill.hold("t6", request.remote_block_ids)
        assert client.reads.wait_completion("again", 10).ok



def test_an_empty_push_ends_the_prefill_hold_at_once(workdir):
    """A decode request that ended before it was scheduled expects nothing (every group empty): the
    prefill daemons write nothing, notify, and the prefill holds end CONSUMED, not at their lease."""
    cluster, rng = small_cluster(workdir, "push-empty")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.hold(request, lease_s=30.0)
        start = time.monotonic()
        (client,) = cluster.decode_clients
        client.submit_push(request.request_id, cluster.prefill_id, request.remote_request_id,
                           tuple(() for _ in request.local_block_ids), num_tokens=70)
        assert client.reads.wait_completion(request.request_id, 10).ok
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        assert time.monotonic() - start < 5 and cluster.decode_untouched()
