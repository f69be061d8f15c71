"""Push through real daemons (issue #57): decode daemons expect, prefill daemons WRITE, every byte checked.

One ``kvxferd serve`` per TP rank, real NIXL, gRPC and ZMQ. A decode rank's push ``ReadSpec`` becomes an
expectation (a hold of its blocks on its own board) that its daemon sends to every prefill daemon it
needs (``Expect``); a prefill daemon writes once its engine holds the transfer, whichever came first;
the decode completion comes when every writer notified; the prefill hold ends CONSUMED on the bus.
"""

import dataclasses
import time

import numpy as np
import pytest

from kvxferd.plan.capability import push_key_digest
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
    """The prefill daemons forget the expectation at their deadline and say so: the decode side fails the push
    then, not after its settle cap (20 s here), which only a silent writer costs (the next test)."""
    cluster, rng = small_cluster(workdir, "push-deadline", daemon_args=("--push-settle-s", "20"))
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        start = time.monotonic()
        cluster.expect(request, deadline_s=0.5)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok and "deadline" in completion.error
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]
        assert 0.5 <= time.monotonic() - start < 6, "the prefill's word should end the wait, not the 20 s cap"
        # The prefill engine holds it only now: its daemons forgot the expectation, nothing is written.
        cluster.hold(request, push=True)
        time.sleep(0.3)
        assert cluster.decode_untouched()


def test_a_failed_push_keeps_its_blocks_until_every_writer_said_its_write_is_over(workdir):
    """The decode side keeps a failed push's blocks until each writer that had not reported does (push_settle_s
    at most): a late WRITE must not land in blocks the engine reuses. A writer that cannot say it (its daemon
    stopped before the deadline) holds them back for the whole cap (20 s here), though the other one spoke."""
    import os
    import signal

    cluster, rng = small_cluster(workdir, "push-settle", daemon_args=("--push-settle-s", "20"))
    with cluster:
        silent = random_request("silent", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        pid = cluster.prefill_daemons[1].process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            cluster.expect(silent, deadline_s=1.0)
            (completion,) = cluster.completions(silent, timeout_s=30)  # the live writer's word is not enough
            assert not completion.ok and time.monotonic() - start >= 20 and cluster.decode_untouched()
        finally:
            os.kill(pid, signal.SIGCONT)


def test_a_push_the_decode_engine_released_is_failed_and_never_written(workdir):
    """An abort on the decode side: the engine releases the transfer id (its expectation). The prefill
    daemons' writes that come with the later hold find no expectation on the decode board and write
    nothing; the prefill holds end at once (FAILED for the decode rank, then CONSUMED: nobody else will
    read them), not by their lease."""
    cluster, rng = small_cluster(workdir, "push-abort")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        assert eventually(lambda: expectations_kept(cluster))  # the expectations reached the prefill daemons
        for client in cluster.decode_clients:
            client.release(request.remote_request_id)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok and "released" in completion.error
        cluster.hold(request, lease_s=30.0, push=True)
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
        cluster.expect(request)
        digest = push_key_digest(cluster.push_key(request.remote_request_id))
        for client in cluster.prefill_clients:
            client.hold(request.remote_request_id, other.remote_block_ids, push_key_digest=digest)
        assert all(c.ok for c in cluster.completions(request))
        assert cluster.verify(request)[1] > 0


def test_bad_pushes_are_refused_as_completions_with_nothing_written(workdir):
    cluster, rng = small_cluster(workdir, "push-bad")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        (client,) = cluster.decode_clients
        cluster.reset_decode()
        key = bytes(range(16))
        spec = client.push_spec("with-ids", cluster.prefill_id, "t1", key, request.local_block_ids)
        spec.remote_block_ids = b"\x00" * 4
        spec.remote_group_sizes.extend([1])
        out_of_range = client.push_spec("far", cluster.prefill_id, "t2", key, (np.array([10**6]),))
        unknown = client.push_spec("unknown", "nobody", "t3", key, request.local_block_ids)
        keyless = client.push_spec("keyless", cluster.prefill_id, "t7", b"short", request.local_block_ids)
        client.reads.submit_reads([spec, out_of_range, unknown, keyless])
        refused = {r: client.reads.wait_completion(r, 10) for r in ("with-ids", "far", "unknown", "keyless")}
        assert {r: (c.ok, c.refused_code) for r, c in refused.items()} == {  # INVALID_ARGUMENT, NOT_FOUND
            "with-ids": (False, 3), "far": (False, 3), "unknown": (False, 5), "keyless": (False, 3)}
        assert "push_key" in refused["keyless"].error
        # A transfer id expected twice at once: the second is refused, the first goes on.
        client.submit_push("first", cluster.prefill_id, "t4", key, request.local_block_ids, num_tokens=70)
        client.submit_push("second", cluster.prefill_id, "t4", key, request.local_block_ids, num_tokens=70)
        second = client.reads.wait_completion("second", 10)
        assert not second.ok and second.refused_code == 3 and "already held" in second.error
        # Another transfer naming blocks a live expectation names (another request's): refused, nothing held.
        client.submit_push("overlap", cluster.prefill_id, "t5", key, request.local_block_ids, num_tokens=70)
        overlap = client.reads.wait_completion("overlap", 10)
        assert not overlap.ok and overlap.refused_code == 3 and "expected by another push" in overlap.error
        for prefill in cluster.prefill_clients:
            prefill.hold("t4", request.remote_block_ids, push_key_digest=push_key_digest(key))
        assert client.reads.wait_completion("first", 10).ok
        # Once it completed, its blocks may be expected again.
        client.submit_push("again", cluster.prefill_id, "t6", key, request.local_block_ids, num_tokens=70)
        for prefill in cluster.prefill_clients:
            prefill.hold("t6", request.remote_block_ids, push_key_digest=push_key_digest(key))
        assert client.reads.wait_completion("again", 10).ok



def test_an_empty_push_ends_the_prefill_hold_at_once(workdir):
    """A decode request that ended before it was scheduled expects nothing (every group empty): the
    prefill daemons write nothing, notify, and the prefill holds end CONSUMED, not at their lease."""
    cluster, rng = small_cluster(workdir, "push-empty")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.hold(request, lease_s=30.0, push=True)
        start = time.monotonic()
        (client,) = cluster.decode_clients
        client.submit_push(request.request_id, cluster.prefill_id, request.remote_request_id,
                           cluster.push_key(request.remote_request_id), tuple(() for _ in request.local_block_ids),
                           num_tokens=70)
        assert client.reads.wait_completion(request.request_id, 10).ok
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        assert time.monotonic() - start < 5 and cluster.decode_untouched()


def test_only_the_push_key_opens_a_prefill_hold(workdir):
    """The transfer id is a name (bus events and logs carry it); the push key is the secret. An expectation
    with another key, or one of a hold placed for reads (no digest), is refused at once: nothing written,
    the decode side failed well before its deadline, the prefill hold untouched (the right key still gets
    it written, and a pull's hold is still read)."""
    cluster, rng = small_cluster(workdir, "push-key")
    with cluster:
        request = random_request("r", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.hold(request, lease_s=30.0, push=True)
        start = time.monotonic()
        wrong = dataclasses.replace(request, request_id="wrong-key")
        cluster.expect(wrong, deadline_s=20, push_key=bytes(16))
        (completion,) = cluster.completions(wrong, timeout_s=10)
        assert not completion.ok and time.monotonic() - start < 5 and cluster.decode_untouched()
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]
        # The control: the right key gets the same hold written, byte-exact (a failed push's blocks are free
        # again on its daemon before its completion, which waited push_settle_s, reaches the engine).
        cluster.expect(request)
        assert [(c.ok, c.error) for c in cluster.completions(request)] == [(True, "")]
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        # A pull's hold (no digest) is pushed to nobody, whatever the key; it is still read.
        pulled = random_request("p", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.hold(pulled, lease_s=30.0)
        start = time.monotonic()
        cluster.expect(dataclasses.replace(pulled, request_id="push-of-pull"), deadline_s=20)
        (completion,) = cluster.completions(dataclasses.replace(pulled, request_id="push-of-pull"), timeout_s=10)
        assert not completion.ok and time.monotonic() - start < 5 and cluster.decode_untouched()
        assert all(c.ok for c in cluster.read(pulled, hold=False)) and cluster.verify(pulled) == ([], 0)


def test_a_reader_names_only_its_own_rank_as_push_target(workdir):
    """A handshake's push target must be the reader being introduced (engine, rank, TP size): naming
    another engine's rank is refused (INVALID_ARGUMENT) before anything is introduced or connected."""
    import grpc

    from kvxferd.wire.peerinfo import PROTOCOL_VERSION
    from tests.service.test_protocol_defects import observer, peer_stub

    cluster, _ = small_cluster(workdir, "push-target")
    with cluster:
        decode_reply = peer_stub(cluster.decode_daemons[0].peer_address).GetEngineInfo(
            pb.EngineInfoRequest(engine_id=cluster.decode_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
                                 reader_engine_id="observer", reader_tp_size=1,
                                 reader_agent_metadata=observer().metadata()), timeout=5)
        prefill = peer_stub(cluster.prefill_daemons[0].peer_address)

        def introduce(reader_engine_id: str):
            request = pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION,
                                           tp_rank=0, reader_engine_id=reader_engine_id, reader_tp_rank=0,
                                           reader_tp_size=1, reader_agent_metadata=observer().metadata())
            request.reader_target.CopyFrom(decode_reply)
            return prefill.GetEngineInfo(request, timeout=5)

        with pytest.raises(grpc.RpcError) as refused:
            introduce("observer")  # the decode engine's rank as the observer's push target
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reader_target" in refused.value.details()
        assert introduce(cluster.decode_id).payload  # the control: the same target for its own engine is taken


def test_a_decode_daemon_with_push_targets_off_refuses_pushes_and_still_reads(workdir):
    """``--no-push-targets`` on the decode side: its ranks name no write target at their handshakes (no
    holder learns their data agent), a push is refused up front (FAILED_PRECONDITION), nothing written;
    the control: a read of the same request through the same daemons is byte-exact."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    with DaemonCluster(prefill_groups, decode_groups, 1, 1, workdir=workdir, name="push-off",
                       args_of=lambda daemon_id: ("--no-push-targets",) if daemon_id == "push-off-d0" else ()) as cluster:
        request = random_request("r", prefill_groups, decode_groups, 70, np.random.default_rng(3))
        cluster.reset_decode()
        cluster.expect(request)
        (refused,) = cluster.completions(request, timeout_s=10)
        assert not refused.ok and refused.refused_code == 9 and "push_targets" in refused.error
        assert cluster.decode_untouched()
        assert all(c.ok for c in cluster.read(dataclasses.replace(request, request_id="read")))
        assert cluster.verify(request) == ([], 0)


def layers_as_expected(cluster, request, num_final: int) -> list[str]:
    """Per decode region (a layer each here): the first ``num_final`` of every group hold the oracle's bytes,
    the others are untouched (the sentinel); the problems found."""
    from kvxferd.rig.verify.buffers import expected_buffers
    from kvxferd.rig.verify.physical import SENTINEL

    problems = []
    for decode in cluster.decode:
        expected = expected_buffers(decode.cache, cluster.prefill_groups, request)
        for g, (buffers, wanted) in enumerate(zip(decode.buffers, expected)):
            for layer, (buffer, want) in enumerate(zip(buffers, wanted)):
                if layer < num_final and not np.array_equal(buffer, want):
                    problems.append(f"rank {decode.cache.tp_rank} group {g} layer {layer}: not the oracle's bytes")
                if layer >= num_final and not np.all(buffer == SENTINEL):
                    problems.append(f"rank {decode.cache.tp_rank} group {g} layer {layer}: written before it was final")
    return problems


def eventually(predicate, timeout_s: float = 10.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s`` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def expectations_kept(cluster) -> bool:
    """Every prefill daemon keeps the decode ranks' expectation (``kvxferd_push_expectations``): it arrived."""
    return all(daemon.metric("kvxferd_push_expectations") >= 1 for daemon in cluster.prefill_daemons)


LAYER_CASES = [("gqa", 2, 1), ("hybrid", 1, 2)]


@pytest.mark.parametrize("model,prefill_tp,decode_tp", LAYER_CASES, ids=[f"{m}-P{p}D{d}" for m, p, d in LAYER_CASES])
def test_a_push_written_layer_by_layer_writes_each_layer_once_it_is_final(workdir, model, prefill_tp, decode_tp):
    """The prefill engine holds before its forward pass (no layer final) and says when layers are: each is
    written then, never before; the last one's write ends the push (CONSUMED on the bus, byte-exact)."""
    prefill_groups, decode_groups = model_groups(model, ModelShape(prefill_block_size=32))
    rng = np.random.default_rng(13)
    with DaemonCluster(prefill_groups, decode_groups, prefill_tp, decode_tp, workdir=workdir,
                       name=f"push-layers-{model}") as cluster:
        request = random_request("staged", prefill_groups, decode_groups, 90, rng, cached_tokens=32, contiguous=False)
        num_groups = len(prefill_groups)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        cluster.hold(request, push=True, layers_final=[0] * num_groups)
        assert eventually(lambda: expectations_kept(cluster))  # each started on the hold, nothing final
        time.sleep(0.3)  # a write that came too early would land meanwhile
        assert layers_as_expected(cluster, request, 0) == []
        cluster.final_layers(request, [1] * num_groups)
        assert eventually(lambda: layers_as_expected(cluster, request, 1) == [])
        assert all(client.reads.take_completions() == [] for client in cluster.decode_clients)
        cluster.final_layers(request, [2] * num_groups)  # every layer: the push ends
        completions = cluster.completions(request)
        assert [(c.ok, c.error) for c in completions] == [(True, "")] * decode_tp
        problems, wrong = cluster.verify(request)
        assert not problems and wrong == 0
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * prefill_tp
        assert layers_as_expected(cluster, request, 1) != []  # the check sees a layer written (negative control)


def test_layers_stored_inside_one_region_are_pushed_layer_by_layer(workdir):
    """vLLM 0.32's caches (every attention layer in one strided view whose blocks hold their layers side by
    side, every Mamba layer's pages in one region): stages go on the connection's plan by layer. With the first
    of three layers final the decode blocks are partly written, with all of them byte-exact."""
    from kvxferd.layout.specs import AttentionSpec, MambaSpec
    from kvxferd.plan.groups import CacheGroup
    from kvxferd.rig.verify.physical import SENTINEL
    from tests.plan.test_push_layers import layer_of_byte
    from tests.rig.verify.test_sweep import mamba_layers, strided

    attention = AttentionSpec("strided", num_blocks=16, num_kv_heads=4, head_size=8, block_size=16, num_layers=3)
    mamba = MambaSpec(num_blocks=16, num_heads=4, head_dim=2, num_groups=1, state_size=3, conv_window=3)

    def groups(tp):
        return [CacheGroup("full", strided(attention, tp, "BLHNC", "kv")), CacheGroup("mamba", mamba_layers(mamba, tp, "BL"))]

    with DaemonCluster(groups(1), groups(2), 1, 2, workdir=workdir, name="push-layers-strided") as cluster:
        request = random_request("staged", cluster.prefill_groups, cluster.decode_groups, 70, np.random.default_rng(3))
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        cluster.hold(request, push=True, layers_final=[1, 1])
        assert eventually(lambda: not cluster.decode_untouched())
        problems, wrong = cluster.verify(request)
        assert not cluster.decode_untouched() and wrong > 0  # the first layer only
        for decode in cluster.decode:  # every byte of layers 1 and 2 (the brute-force map) still the sentinel
            later = (layer_of_byte(decode) % 10_000) >= 1
            assert np.all(decode.arena[later] == SENTINEL)
        cluster.final_layers(request, [3, 3])
        assert [(c.ok, c.error) for c in cluster.completions(request)] == [(True, "")] * 2
        problems, wrong = cluster.verify(request)
        assert not problems and wrong == 0
        # On one host each stage is a copy on the plan by layer's own tables (two decode ranks, two stages)
        assert cluster.prefill_daemons[0].metric("kvxferd_push_same_host_copies_total") == 4


def held_first_layer(cluster, rng, name: str, deadline_s: float):
    """A push the decode rank expects (``deadline_s``) and the prefill engine holds with its first layer final."""
    request = random_request(name, cluster.prefill_groups, cluster.decode_groups, 70, rng)
    cluster.reset_decode()
    cluster.expect(request, deadline_s=deadline_s)
    cluster.hold(request, push=True, layers_final=[1], lease_s=30.0)
    return request


def test_a_push_whose_last_layers_are_never_final_fails_at_its_deadline(workdir):
    """A prefill engine that holds layer by layer and never says its last layer is final: the push fails at the
    expectation's deadline (every block invalid), the layers it wrote and those it did not alike."""
    cluster, rng = small_cluster(workdir, "push-layers-stuck")
    with cluster:
        request = held_first_layer(cluster, rng, "stuck", deadline_s=1.0)
        (completion,) = cluster.completions(request, timeout_s=15)
        assert not completion.ok
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]
        failed = [s.wait_for(request.remote_request_id, kinds=(pb.NotifyEvent.FAILED,), timeout_s=10)
                  for s in cluster.subscribers]
        assert all(e is not None and "last layers" in e.reason for e in failed)
        # refused, naming the field: layers of a hold nobody pushes, more layers than the engine has
        import grpc
        with pytest.raises(grpc.RpcError, match="one count per cache group"):  # an empty FinalLayers
            cluster.prefill_clients[0].stub.FinalLayers(pb.FinalLayersRequest(
                engine_id=cluster.prefill_clients[0].engine_id, request_id=request.remote_request_id))
        with pytest.raises(grpc.RpcError, match="push_key_digest"):
            cluster.prefill_clients[0].hold("reads-only", request.remote_block_ids, layers_final=[0])
        with pytest.raises(grpc.RpcError, match="layers_final"):
            cluster.prefill_clients[0].hold("too-many", request.remote_block_ids, layers_final=[3],
                                            push_key_digest=b"d" * 32)


def test_final_layers_said_before_their_hold_count_when_it_comes(workdir):
    """The engine's worker says layers are final on its own socket; its scheduler's hold may reach the daemon
    after that: the daemon keeps what was said (a few seconds) and the hold starts from it."""
    cluster, rng = small_cluster(workdir, "push-layers-ahead")
    with cluster:
        request = random_request("ahead", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        # the first layer, before the hold: on the same reads socket, so the daemon takes it first
        cluster.final_layers(request, [1])
        cluster.hold(request, push=True, layers_final=[0])
        assert eventually(lambda: layers_as_expected(cluster, request, 1) == [])  # layer 0 written, layer 1 not
        cluster.final_layers(request, [2])
        assert [(c.ok, c.error) for c in cluster.completions(request, timeout_s=10)] == [(True, "")]
        problems, wrong = cluster.verify(request)
        assert not problems and wrong == 0


def test_a_push_waiting_for_layers_ends_at_once_when_its_prefill_hold_is_released(workdir):
    """An abort on the prefill side while the push waits for layers: the decode rank hears at once, not at the
    expectation's deadline (20 s here)."""
    cluster, rng = small_cluster(workdir, "push-layers-released")
    with cluster:
        request = held_first_layer(cluster, rng, "released", deadline_s=20)
        # every writer's expectation started on the hold (one that came after the release would wait for its
        # deadline), and the first layer is written
        assert eventually(lambda: expectations_kept(cluster) and not cluster.decode_untouched())
        start = time.monotonic()
        for client in cluster.prefill_clients:
            client.release(request.remote_request_id)
        (completion,) = cluster.completions(request, timeout_s=15)
        assert not completion.ok and time.monotonic() - start < 5


def test_a_prefill_engine_that_deregisters_tells_the_pushes_it_never_began(workdir):
    """The prefill engine goes away (deregisters, or its process dies) with an expectation waiting for its hold:
    the decode rank hears at once, not at the expectation's deadline nor after its settle cap (20 s each)."""
    cluster, rng = small_cluster(workdir, "push-prefill-gone", daemon_args=("--push-settle-s", "20"))
    with cluster:
        request = random_request("gone", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        assert eventually(lambda: expectations_kept(cluster))
        start = time.monotonic()
        for client in cluster.prefill_clients:
            client.deregister()
        (completion,) = cluster.completions(request, timeout_s=15)
        assert not completion.ok and time.monotonic() - start < 5 and cluster.decode_untouched()


def test_a_push_started_on_one_hold_is_not_finished_from_another_of_the_same_id(workdir):
    """The prefill engine lets its layer-by-layer hold go and holds the transfer id again on other blocks (vLLM
    does when a prompt was scheduled again): the push started on the first hold fails, and the second hold's
    blocks are written nowhere (its layers would otherwise follow the first hold's plan)."""
    cluster, rng = small_cluster(workdir, "push-layers-again")
    with cluster:
        request = random_request("again", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        cluster.hold(request, push=True, layers_final=[0], lease_s=30.0)
        assert eventually(lambda: expectations_kept(cluster))  # started on this hold, nothing final yet
        other = dataclasses.replace(request, remote_block_ids=tuple(ids[::-1] for ids in request.remote_block_ids))
        digest = push_key_digest(cluster.push_key(request.remote_request_id))
        for client in cluster.prefill_clients:  # release and hold again back to back on the reads socket: the
            # daemon most likely takes both before the push hears of either (else it hears of the release)
            client.reads._stream.put(pb.ReadBatch(releases=[pb.ReleaseRequest(request_id=request.remote_request_id)]))
            client.hold(request.remote_request_id, other.remote_block_ids, lease_s=30.0, push_key_digest=digest,
                        layers_final=[0])
        cluster.final_layers(other, [2])
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok
        time.sleep(0.3)  # a write of the second hold's blocks would land meanwhile
        assert cluster.decode_untouched()


def test_one_reader_keeps_at_most_max_expectations_per_reader_on_a_prefill_rank(workdir):
    """A decode daemon (one reader identity) cannot fill a prefill rank with expectations: past
    max_expectations_per_reader (1 here) the prefill side refuses the next one at once, nothing written; an
    expectation that ended makes room again (the count goes down, and it was the bound that refused)."""
    cluster, rng = small_cluster(workdir, "push-per-reader", daemon_args=("--max-expectations-per-reader", "1"))
    with cluster:
        first = random_request("a", cluster.prefill_groups, cluster.decode_groups, 70, rng)
        second = next(r for r in (random_request("b", cluster.prefill_groups, cluster.decode_groups, 70, rng,
                                                 contiguous=False) for _ in range(100))
                      if not any(set(mine.tolist()) & set(theirs.tolist())  # (blocks of its own)
                                 for mine, theirs in zip(first.local_block_ids, r.local_block_ids)))
        cluster.reset_decode()
        cluster.expect(first, deadline_s=20)
        assert eventually(lambda: expectations_kept(cluster))  # the first is kept on the prefill side
        start = time.monotonic()
        cluster.expect(second, deadline_s=20)
        (refused,) = cluster.completions(second, timeout_s=10)
        assert not refused.ok and time.monotonic() - start < 5, "refused at once, not at its 20 s deadline"
        cluster.hold(second, push=True)
        time.sleep(0.3)  # a write of the refused expectation's blocks would land meanwhile
        assert cluster.decode_untouched(), "a refused expectation must not be written"
        cluster.hold(first, push=True)
        assert [c.ok for c in cluster.completions(first, timeout_s=10)] == [True]
        # The first ended: the same reader may expect again (another transfer, the same blocks), and is written.
        third = dataclasses.replace(second, request_id="c", remote_request_id="c@prefill")
        assert [c.ok for c in cluster.push(third, timeout_s=10)] == [True]


def test_a_write_in_flight_when_its_prefill_engine_deregisters_is_told_without_the_settle_wait(workdir):
    """A big WRITE over UCX's TCP lane (512 MiB: about 0.3 s) is in flight when the prefill engine
    deregisters: its daemon aborts it, waits for its drain and tells the decode rank the WRITE is over, so the
    push fails well before the decode side's settle cap (20 s here), and nothing lands after its completion.
    (Before the daemon waited for it, the notice also came in time here: the executor's close drained it.)"""
    import functools

    from kvxferd.client.launch import DaemonProcess
    from kvxferd.plan.engine import ReadRequest
    from kvxferd.rig.bench.common import full_attention_groups

    # 512 MiB a request: at 128 MiB (about 80 ms on an idle machine) the WRITE sometimes ended before the
    # Deregister reached the daemon, and the push completed ok (1 run in 4, here, at cb4c157 too)
    groups = full_attention_groups(16, 512)
    start_many = functools.partial(DaemonProcess.start_many, env={"UCX_TLS": "tcp"})
    with DaemonCluster(groups, groups, 1, 1, workdir=workdir, name="push-gone-writing", start_many=start_many,
                       daemon_args=("--push-settle-s", "20", "--no-same-host-writes")) as cluster:
        ids = np.arange(512)
        request = ReadRequest("w", "w@p", (ids,), (ids,))
        cluster.reset_decode()
        cluster.expect(request, deadline_s=30)
        assert eventually(lambda: expectations_kept(cluster))
        cluster.hold(request, push=True)  # the WRITE starts
        start = time.monotonic()
        cluster.prefill_clients[0].deregister()
        (completion,) = cluster.completions(request, timeout_s=30)
        assert not completion.ok and time.monotonic() - start < 10, (completion.error, time.monotonic() - start)
        landed = [decode.arena.copy() for decode in cluster.decode]
        time.sleep(0.3)
        assert all(np.array_equal(before, decode.arena) for before, decode in zip(landed, cluster.decode))
