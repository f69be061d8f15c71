"""Reads through real daemons: one ``kvxferd serve`` process per TP rank, real NIXL, gRPC and ZMQ.

Each case holds requests on every prefill rank, reads them on every decode
rank through the decode daemons, checks every decode byte against the
oracle, and requires exactly one CONSUMED event per prefill rank.
"""

import os

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION

CASES = [("gqa", 2, 1), ("gqa", 1, 2), ("mla", 2, 1), ("hybrid", 2, 1)]


@pytest.mark.parametrize("model,prefill_tp,decode_tp", CASES, ids=[f"{m}-P{p}D{d}" for m, p, d in CASES])
def test_reads_through_daemons_are_byte_exact(workdir, model, prefill_tp, decode_tp):
    prefill_groups, decode_groups = model_groups(model, ModelShape(prefill_block_size=32))
    rng = np.random.default_rng(7)
    requests = [random_request("full", prefill_groups, decode_groups, 70, rng),
                random_request("hit", prefill_groups, decode_groups, 90, rng, cached_tokens=32, contiguous=False)]
    with DaemonCluster(prefill_groups, decode_groups, prefill_tp, decode_tp, workdir=workdir, name=model) as cluster:
        for request in requests:
            cluster.reset_decode()
            completions = cluster.read(request)
            for completion in completions:
                assert completion.ok, completion.error
                assert completion.num_bytes > 0 and completion.num_descriptors > 0
                assert not completion.invalid_block_ids and completion.post_s > 0
                # where the daemon's time went: the stages add up to the read's duration
                assert 0 < completion.plan_s < completion.post_s
                assert completion.transfer_s >= 0 and completion.check_s > 0
                stages_s = completion.post_s + completion.transfer_s + completion.check_s
                assert abs(stages_s - completion.duration_s) < 1e-3, (stages_s, completion.duration_s)
            problems, wrong = cluster.verify(request)
            assert not problems and wrong == 0
            events = cluster.hold_events(request)
            assert [e.kind for e in events] == [pb.NotifyEvent.CONSUMED] * prefill_tp
            for event in events:  # the engine gets back exactly the blocks it held
                assert [list(b.ids) for b in event.block_ids] == [list(ids) for ids in request.remote_block_ids]
        # Exactly one event per hold: nothing else was published.
        for subscriber in cluster.subscribers:
            assert subscriber.next(timeout_s=0.3) is None and subscriber.last_seq == len(requests)


@pytest.mark.parametrize("same_host,by_fd,workers", [(True, False, False), (True, True, False), (False, False, False),
                                                     (True, True, True)],
                         ids=["same-host", "same-host-fd", "nixl", "same-host-fd-reader-workers"])
def test_a_same_host_holder_is_copied_from_byte_exact_and_only_when_both_allow_it(workdir, same_host, by_fd, workers):
    """Issue #37: the decode daemons prove they share the prefill daemons' host and copy from the prefill
    engines' shared memory themselves; board checks, CONSUMED and the stages as over NIXL. Engines that pass
    their memory as an fd (``by_fd``, as the vLLM connector does) are opened through the holder's copy of
    the fd; with reader workers (issue #55), whose sandbox keeps them out of /proc/<holder>/fd, the daemon
    opens it and hands the worker the fd. With the reader's ``--no-same-host-reads`` (the control) every
    byte comes over NIXL, as exact."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    rng = np.random.default_rng(11)
    request = random_request("same-host", prefill_groups, decode_groups, 70, rng)
    args = (() if same_host else ("--no-same-host-reads",)) + \
        (("--dataplane-workers", "--dataplane-reader-workers") if workers else ())
    with DaemonCluster(prefill_groups, decode_groups, 2, 1, workdir=workdir, name=f"sh-{same_host}-{by_fd}-{workers}",
                       daemon_args=args, by_fd=by_fd) as cluster:
        cluster.reset_decode()
        completions = cluster.read(request)
        assert all(c.ok for c in completions), [c.error for c in completions]
        problems, wrong = cluster.verify(request)
        assert not problems and wrong == 0
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        copies = sum(d.metric("kvxferd_same_host_copies_total") for d in cluster.decode_daemons)
        assert copies == (2 if same_host else 0)  # one per prefill rank read
        # With reader workers the engine's session went to its worker: the read never passed the daemon.
        handed = sum(d.metric("kvxferd_reader_worker_sessions_total") for d in cluster.decode_daemons)
        assert handed == (1 if workers else 0)
        # Issue #58: each daemon's agents (an agent and a notice agent per rank it drives itself) wake its
        # data-plane thread through UCX's tcp sockets; ranks served by workers are driven there.
        sets = [d.metric("kvxferd_wake_sets") for d in (*cluster.prefill_daemons, *cluster.decode_daemons)]
        assert workers or all(n >= 2 for n in sets), sets


def test_a_holder_names_its_shared_memory_only_to_a_reader_that_proves_this_host(workdir):
    """GetEngineInfo without a token, or with one of another secret, gets addresses only; with this host's,
    the names and the holder's own proof (which the reader checks before it maps anything)."""
    import grpc

    from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
    from kvxferd.wire.peerauth import (default_peer_secret_file, prove_secret, read_peer_secret,
                                       secret_call_metadata)
    from kvxferd.wire.samehost import holder_proof, same_host_token
    from tests.service.test_protocol_defects import observer
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    with DaemonCluster(prefill_groups, decode_groups, 1, 1, workdir=workdir, name="names") as cluster, \
            grpc.insecure_channel(cluster.prefill_daemons[0].peer_address) as channel:
        address = cluster.prefill_daemons[0].peer_address
        secret = read_peer_secret(default_peer_secret_file())  # the daemons' (and peer_channel's) default
        stub = peer_grpc.PeerServiceStub(channel)

        def info(token_of) -> tuple[pb.EngineInfo, str]:
            nonces = prove_secret(stub, secret, address)  # the token is bound to this call's challenge
            token = token_of(nonces)
            reply = stub.GetEngineInfo(pb.EngineInfoRequest(
                engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id="names",
                reader_tp_size=1, reader_agent_metadata=observer().metadata(), same_host_token=token),
                metadata=secret_call_metadata(secret, address, nonces), timeout=10)
            message = pb.EngineInfo()
            message.ParseFromString(reply.payload)
            return message, token

        def names(message: pb.EngineInfo) -> set[str]:
            return {r.handle.shm_name for g in message.engine.groups for r in g.regions}

        for refused in (lambda n: "", lambda n: same_host_token(b"x" * 32, address, n),
                        lambda n: same_host_token(secret, "127.0.0.1:1", n),
                        lambda n: same_host_token(secret, address, type(n)(b"c" * 16, n.server))):
            message, _ = info(refused)
            assert names(message) == {""} and message.same_host_proof == ""
            assert not message.hold_board.HasField("share")  # nor the board's memfd
        message, token = info(lambda n: same_host_token(secret, address, n))
        assert names(message) == {cluster.arenas[0].name}
        assert message.same_host_proof == holder_proof(secret, address, token)
        share = message.hold_board.share  # the board's memfd, held open by the holder daemon
        assert share.WhichOneof("source") == "shm_fd_index" and share.holder_pid == cluster.prefill_daemons[0].process.pid
        status = os.stat(f"/proc/{share.holder_pid}/fd/{share.holder_fd}")
        assert (status.st_dev, status.st_ino) == (share.shm_device, share.shm_inode)
