"""The engine's reads session handed to its reader worker (issue #55, service/net/sessions.py) against real
daemons, real NIXL and the engine's own client: the reads of a session never pass through the daemon (a
frozen daemon still completes them; the control: with ``--no-reader-worker-sessions`` the same read waits
for the daemon), and a reader worker killed under a session loses no read (the client opens the session
again; reads without a completion are sent again)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster, dataplane_workers
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request

pytestmark = pytest.mark.daemons
GROUPS = model_groups("gqa", ModelShape())
WORKERS = ("--dataplane-workers", "--dataplane-reader-workers")
FROZEN_WAIT_S = 3.0  # how long the control's read is given while its daemon is stopped (nothing can come)
HANDED_WAIT_S = 20.0  # a handed session's read completes in milliseconds; the daemon stays stopped meanwhile


def cluster_of(workdir, name: str, *extra: str) -> DaemonCluster:
    return DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name=name, daemon_args=(*WORKERS, *extra))


def read_with_the_daemon_stopped(cluster: DaemonCluster, request, wait_s: float) -> pb.Completion | None:
    """Hold ``request``, stop (SIGSTOP) the decode daemon, read; the completion if it came within ``wait_s``
    with the daemon stopped all along, else None (it is then awaited after the daemon goes on)."""
    decode = cluster.decode_daemons[0]
    cluster.hold(request)
    os.kill(decode.process.pid, signal.SIGSTOP)
    try:
        cluster.submit(request)
        try:
            return cluster.decode_clients[0].reads.wait_completion(request.request_id, wait_s)
        except TimeoutError:
            return None
    finally:
        os.kill(decode.process.pid, signal.SIGCONT)


@pytest.mark.parametrize("handed", [True, False], ids=["sessions-in-workers", "control-sessions-in-daemon"])
def test_a_sessions_reads_complete_while_the_daemon_is_stopped(workdir, handed):
    """The session is the worker's: with the decode daemon stopped, a read of a ready link is admitted,
    copied, checked and completed byte-exact; its notice waits for the daemon (which sends it from the
    notice agent once it goes on: the hold ends CONSUMED). The control: a session the daemon serves
    (``--no-reader-worker-sessions``) gets nothing while the daemon is stopped, and the same read once it
    goes on."""
    rng = np.random.default_rng(31)
    with cluster_of(workdir, f"ss-{handed}", *(() if handed else ("--no-reader-worker-sessions",))) as cluster:
        decode = cluster.decode_daemons[0]
        warm = random_request("ss-warm", *GROUPS, 64, rng)
        cluster.reset_decode()
        assert all(c.ok for c in cluster.read(warm)), "the first read: the session and the link set up"
        assert cluster.verify(warm) == ([], 0)
        assert decode.metric("kvxferd_reader_worker_sessions_total") == (1 if handed else 0)
        # The prefill engine only holds: its session stays with its daemon (holds are the daemon's anyway).
        assert cluster.prefill_daemons[0].metric("kvxferd_reader_worker_sessions_total") == 0
        request = random_request("ss-frozen", *GROUPS, 64, rng)
        cluster.reset_decode()
        completion = read_with_the_daemon_stopped(cluster, request, HANDED_WAIT_S if handed else FROZEN_WAIT_S)
        if handed:
            assert completion is not None and completion.ok, completion
        else:
            assert completion is None, "the daemon served this session: nothing can come while it is stopped"
            completion = cluster.decode_clients[0].reads.wait_completion(request.request_id, 20)
            assert completion.ok, completion
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def test_a_reader_worker_killed_under_a_session_loses_no_read(workdir):
    """Reads in flight when the worker serving the session dies: the session breaks without the daemon's
    word, the client opens a new one (the daemon hands it to the next generation, numbering on from the
    engine's ack) and sends the reads that had no completion again. Every read completes: ok and
    byte-exact, or failed with every local block invalid; none is lost, none completes twice."""
    rng = np.random.default_rng(32)
    with cluster_of(workdir, "ss-kill") as cluster:
        decode, client = cluster.decode_daemons[0], cluster.decode_clients[0]
        warm = random_request("ss-kill-warm", *GROUPS, 64, rng)
        assert all(c.ok for c in cluster.read(warm))
        requests = [random_request(f"ss-kill-{n}", *GROUPS, 16, rng) for n in range(4)]
        for request in requests:
            cluster.hold(request)
        (first,) = dataplane_workers(decode.process.pid, "reader")
        cluster.reset_decode()
        for request in requests:
            cluster.submit(request)
        os.kill(first, signal.SIGKILL)
        outcomes = []
        for request in requests:
            completion = client.reads.wait_completion(request.request_id, 30)
            local = sorted(np.concatenate([np.asarray(ids) for ids in request.local_block_ids]).tolist())
            assert completion.ok or sorted(np.concatenate([b.ids for b in completion.invalid_block_ids]).tolist()) \
                == local, completion
            outcomes.append(completion.ok)
        # A read's completion is written before its holder is told, so none was lost with the worker after
        # its hold was consumed: each ran again, from its hold, and read ok.
        assert all(outcomes), outcomes
        assert client.reads.num_reopened >= 1
        time.sleep(0.5)
        assert not client.reads.take_completions(), "a read completed twice"
        # The next generation serves the reopened session: a new read is ok and byte-exact.
        deadline = time.monotonic() + 30
        while True:
            again = random_request(f"ss-kill-again-{time.monotonic_ns()}", *GROUPS, 64, rng)
            cluster.reset_decode()
            if all(c.ok for c in cluster.read(again, timeout_s=20)):
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert cluster.verify(again) == ([], 0)
        (second,) = dataplane_workers(decode.process.pid, "reader")
        assert second != first and decode.metric("kvxferd_reader_worker_sessions_total") >= 2
        print(f"reads in flight at the kill: {outcomes} (ok or failed whole); sessions reopened: "
              f"{client.reads.num_reopened}")


def test_a_session_handed_over_at_its_first_batch_leaves_the_engines_session_token_behind(workdir):
    """A first batch that carries reads (a session opened again with reads in flight, as the client does)
    goes to the worker at once, and it carries the registration's session, the engine's proof on the
    control plane: the daemon keeps it back. Searched for in the reader worker's memory after such a
    session read byte-exact; the control: the daemon's memory has it. (With the token left in, by hand,
    2026-11-30: found in the worker, the test fails.)"""
    from kvxferd.client.engine import EngineClient
    from kvxferd.client.readsock import ReadsSocketStream
    from kvxferd.rig.attack.reach import search_process_memory

    rng = np.random.default_rng(33)
    with cluster_of(workdir, "ss-token") as cluster:
        decode, client = cluster.decode_daemons[0], cluster.decode_clients[0]
        request = random_request("ss-token", *GROUPS, 64, rng)
        capabilities = cluster.hold(request)
        cluster.reset_decode()
        spec = EngineClient.read_spec(request.request_id, cluster.prefill_id, request.remote_request_id,
                                      request.local_block_ids, request.remote_block_ids,
                                      remote_capabilities=capabilities)
        first = pb.ReadBatch(engine_id=cluster.decode_id, session=client.session, reads=[spec])
        stream = ReadsSocketStream(client.reads_socket_path, first, timeout_s=10, max_frame_bytes=16 << 20)
        try:
            batch = next(iter(stream))
        finally:
            stream.cancel()
        assert [c.ok for c in batch.completions] == [True], batch
        assert cluster.verify(request) == ([], 0)
        assert decode.metric("kvxferd_reader_worker_sessions_total") >= 1
        needles = {"session": client.session.encode()}
        assert all(search_process_memory(decode.process.pid, needles).values()), "the control: the daemon has it"
        (reader,) = dataplane_workers(decode.process.pid, "reader")
        assert search_process_memory(reader, needles) == {"session": []}


def test_a_session_served_by_the_daemon_again_takes_the_feed_back(workdir):
    """The engine goes over to the gRPC stream (any transport the daemon serves itself) after its reader
    worker had the session: the daemon numbers on after the engine's ack and tells the worker to drop
    its session, and reads go on byte-exact with no seq used twice."""
    rng = np.random.default_rng(34)
    with cluster_of(workdir, "ss-back") as cluster:
        decode, client = cluster.decode_daemons[0], cluster.decode_clients[0]
        for n in range(3):  # over the reads socket: the worker numbers 1..3
            request = random_request(f"ss-back-{n}", *GROUPS, 16, rng)
            assert all(c.ok for c in cluster.read(request))
        assert decode.metric("kvxferd_reader_worker_sessions_total") == 1
        client.reads_socket_path = None  # the gRPC stream from here on
        client.reconnect_reads()
        request = random_request("ss-back-grpc", *GROUPS, 64, rng)
        cluster.reset_decode()
        (completion,) = cluster.read(request)
        assert completion.ok and completion.seq > 3, completion
        assert cluster.verify(request) == ([], 0)
        assert client.reads.num_duplicates_dropped == 0
