"""Life-cycle of daemons and engines: disconnects, restarts, expiry, dead peers, SIGTERM."""

import dataclasses
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import EngineClient
from kvxferd.plan.capability import CAPABILITY_BYTES
from kvxferd.wire.peerauth import peer_channel
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION

FAST = ("--peer-check-s", "0.3")


def _groups(model="gqa"):
    return model_groups(model, ModelShape())


def _request(name, seed=0):
    prefill_groups, decode_groups = _groups()
    return random_request(name, prefill_groups, decode_groups, 48, np.random.default_rng(seed))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def _metric(daemon, name: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(daemon.addresses["metrics"], timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_engine_disconnect_deregisters_and_expires_its_holds(workdir):
    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name="gone", lease_s=0.6) as cluster:
        request = _request("r")
        cluster.hold(request, lease_s=30)
        prefill = cluster.prefill_clients[0]
        prefill.close()  # the engine dies: no heartbeats, no deregistration
        daemon = cluster.prefill_daemons[0]
        deadline = time.monotonic() + 10
        while _metric(daemon, "kvxferd_engines_registered") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(daemon, "kvxferd_engines_registered") == 0
        observer = EngineClient(daemon.engine_target)
        observer.engine_id = cluster.prefill_id
        assert _code(lambda: observer.stub.Heartbeat(pb.HeartbeatRequest(engine_id=cluster.prefill_id))) == grpc.StatusCode.NOT_FOUND
        peer = peer_grpc.PeerServiceStub(peer_channel(daemon.peer_address))
        assert _code(lambda: peer.GetEngineInfo(pb.EngineInfoRequest(engine_id=cluster.prefill_id,
                                                                     protocol_version=PROTOCOL_VERSION))) \
            == grpc.StatusCode.NOT_FOUND
        # A read from the vanished engine fails cleanly (no hold, no memory behind it).
        cluster.submit(request, deadline_s=3)
        (completion,) = cluster.completions(request)
        assert not completion.ok and completion.invalid_block_ids
        # The engine comes back (a new session: the old one's lease ran out) and learns what became of its hold.
        observer = cluster._register(daemon, cluster.prefill[0])
        (event,) = observer.missed_events(0).events
        assert event.kind == pb.NotifyEvent.EXPIRED and "engine gone" in event.reason
        observer.close()


def test_deregister_ends_the_completion_stream(workdir):
    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name="dereg") as cluster:
        decode = cluster.decode_clients[0]
        decode.deregister()
        deadline = time.monotonic() + 5
        while decode._threads[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not decode._threads[0].is_alive()  # its session's stream ended, saying why
        error = decode.reads.stream_error
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "registration" in error.details(), error


def test_restarted_prefill_daemon_is_picked_up(workdir):
    with DaemonCluster(*_groups(), 2, 1, workdir=workdir, name="restart", daemon_args=FAST) as cluster:
        first = _request("before", 1)
        assert all(c.ok for c in cluster.read(first))
        # Down across several probes: the decode daemon's channel to it goes into
        # reconnect backoff, which must not fail the re-handshake.
        cluster.restart_prefill(1, down_s=5.0)  # new process, new incarnation, same address
        # A read sealed by the new daemon's key may come before any probe saw the restart: it is refused,
        # nothing written, and the link is probed at once (not re-handshaken on the read's word).
        early = _request("early", 5)
        cluster.reset_decode()
        (completion,) = cluster.read(early)
        assert completion.ok or (completion.refused_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
                                 and cluster.decode_untouched()), completion
        time.sleep(1.5)  # that probe, and its re-handshake
        copies = _metric(cluster.decode_daemons[0], "kvxferd_same_host_copies_total")
        for n in range(3):
            request = _request(f"after{n}", 2 + n)
            cluster.reset_decode()
            completions = cluster.read(request)
            assert all(c.ok for c in completions), [c.error for c in completions]
            assert cluster.verify(request) == ([], 0)
            assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        log = cluster.decode_daemons[0].tail(20000)
        assert log.count('"handshake done"') >= 2
        # Same-host (issue #37): the restarted holder's memory was mapped again at the re-handshake.
        assert _metric(cluster.decode_daemons[0], "kvxferd_same_host_copies_total") == copies + 3 * 2


def test_expired_hold_publishes_expired_and_a_late_read_fails(workdir):
    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name="late") as cluster:
        request = _request("late")
        cluster.hold(request, lease_s=0.3)
        (event,) = cluster.hold_events(request)
        assert event.kind == pb.NotifyEvent.EXPIRED and event.reason == "lease"
        cluster.reset_decode()
        cluster.submit(request)  # the hold's tag has left the holder's board: checked first, nothing moves
        (completion,) = cluster.completions(request)
        assert not completion.ok and "stale read, nothing copied" in completion.error
        assert cluster.decode_untouched()
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]
        assert _metric(cluster.decode_daemons[0], "kvxferd_stale_reads_total") == 1
        # No notice for a hold that had ended: it could only count for a later hold of the same id.
        assert _metric(cluster.prefill_daemons[0], "kvxferd_late_notices_total") == 0
        assert _metric(cluster.prefill_daemons[0], "kvxferd_leases_expired_total") == 1
        # A renewed lease outlives its first term.
        renewed = _request("renewed", 3)
        cluster.hold(renewed, lease_s=0.3)
        assert cluster.prefill_clients[0].renew([renewed.remote_request_id, "nope"], lease_s=30) == ["nope"]
        time.sleep(0.6)
        assert all(c.ok for c in cluster.read(renewed, hold=False))
        assert [e.kind for e in cluster.hold_events(renewed)] == [pb.NotifyEvent.CONSUMED]
        # Released by the engine: EXPIRED with the reason, and a read after it fails.
        released = _request("released", 4)
        cluster.hold(released)
        cluster.prefill_clients[0].release(released.remote_request_id)
        (event,) = cluster.hold_events(released)
        assert event.kind == pb.NotifyEvent.EXPIRED and event.reason == "released"
        assert not cluster.read(released, hold=False)[0].ok


def test_killed_prefill_daemon_fails_reads_within_their_deadline(workdir):
    with DaemonCluster(*_groups(), 2, 1, workdir=workdir, name="killed") as cluster:
        request = _request("doomed")
        cluster.hold(request)
        cluster.prefill_daemons[1].kill()
        start = time.monotonic()
        cluster.submit(request, deadline_s=2.0)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert time.monotonic() - start < 2.0 + 1.0
        assert not completion.ok and 1 in completion.failed_ranks
        assert any(len(b.ids) for b in completion.invalid_block_ids)
        # The decode daemon keeps serving: its other engine-facing calls still answer.
        assert cluster.decode_clients[0].missed_events(0).last_seq == 0


def test_a_read_waiting_for_a_re_handshake_with_a_dead_peer_still_ends_by_its_deadline(workdir):
    # A failed read marks the link stale, so the next read re-handshakes first;
    # with a dead peer that handshake outlasts a short deadline (the peer call
    # retries while the peer may come back). No probe interferes (--peer-check-s 60).
    with DaemonCluster(*_groups(), 2, 1, workdir=workdir, name="stalelink",
                       daemon_args=("--peer-check-s", "60")) as cluster:
        first, request = _request("first"), _request("stale-link", 1)
        cluster.hold(first)
        cluster.hold(request)
        cluster.prefill_daemons[1].kill()
        cluster.submit(first, deadline_s=2.0)
        (completion,) = cluster.completions(first, timeout_s=10)
        assert not completion.ok and 1 in completion.failed_ranks
        start = time.monotonic()
        cluster.submit(request, deadline_s=0.5)
        (completion,) = cluster.completions(request, timeout_s=10)
        took_s = time.monotonic() - start
        assert took_s < 0.5 + 0.4, took_s
        assert not completion.ok and completion.error.startswith("deadline"), completion.error
        assert sorted(completion.failed_ranks) == [0, 1]  # nothing was posted: every block is invalid
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]


def test_a_read_whose_re_handshake_is_refused_names_every_block_invalid(workdir):
    """The holder's engine is gone (deregistered: its daemon answers NOT_FOUND at once), the probe made
    the link stale, and the read carries a capability of a registration the link does not know (the
    soak's read after a hold its killed holder could not place: zeros), so it waits for the re-handshake
    unplanned, and that handshake fails. Its completion must still name every local block invalid: an
    engine trusts every block a failed read does not name. (It named none, found by the soak with
    kill_prefill_daemon before the hold; the vLLM connector then failed the whole request, but an
    engine that takes the list at its word would use unwritten blocks.)"""
    with DaemonCluster(*_groups(), 2, 1, workdir=workdir, name="refusedhs",
                       daemon_args=("--peer-check-s", "0.2")) as cluster:
        request = _request("refused-handshake", 2)
        first, _ = cluster.hold(request)
        request = dataclasses.replace(request, remote_capabilities=(first, bytes(CAPABILITY_BYTES)))
        # (released first: an engine that leaves holding stays findable while its holds may be read, issue #60)
        cluster.prefill_clients[1].release(request.remote_request_id)
        cluster.prefill_clients[1].deregister()
        time.sleep(1.0)  # a probe sees the engine gone: the link is stale, its re-handshake refused
        cluster.submit(request, deadline_s=5.0)
        (completion,) = cluster.completions(request, timeout_s=10)
        assert not completion.ok and not completion.refused_code, completion
        assert completion.error.startswith("handshake") and "NOT_FOUND" in completion.error, completion.error
        assert [list(b.ids) for b in completion.invalid_block_ids] == [sorted(set(ids)) for ids in request.local_block_ids]


def test_sigterm_drains_in_flight_reads(workdir):
    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name="drain") as cluster:
        requests = [_request(f"d{n}", n) for n in range(20)]
        for request in requests:
            cluster.hold(request)
        client = cluster.decode_clients[0]
        # one batch: the daemon takes all of it or none; its first completion says it took it
        client.reads.submit_reads([client.read_spec(r.request_id, cluster.prefill_id, r.remote_request_id,
                                                    r.local_block_ids, r.remote_block_ids,
                                                    remote_capabilities=cluster.capabilities[r.remote_request_id])
                                   for r in requests])
        first = client.reads.wait_completion(requests[0].request_id, 10)
        decode = cluster.decode_daemons[0]
        decode.process.send_signal(15)
        completions = [client.reads.wait_completion(r.request_id, 10) for r in requests[1:]] + [first]
        assert len(completions) == 20 and all(c.ok for c in completions)
        assert decode.process.wait(30) == 0
    assert '"drained"' in decode.tail(5000)


@pytest.mark.parametrize("frozen_s, holding", [(3.0, False), (1.3, True)])
def test_a_daemon_frozen_longer_than_the_registration_lease_keeps_its_engines(workdir, frozen_s, holding):
    """Found by the soak (stop_long): on SIGCONT the daemon dropped every engine as gone, although the
    engines had heartbeated all along to a daemon that could not answer; every read failed after it.
    Again by the soak (seed 23) for a stop shorter than the 2 s between sweeps that count as a pause:
    with a hold outstanding the sweep comes every 0.2 s, so a 1.3 s stop (against a 0.9 s lease) was
    no pause. A lease now counts only time in which the daemon ran."""
    import os
    import signal

    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name=f"frozen{frozen_s:g}", lease_s=0.9) as cluster:
        daemon = cluster.prefill_daemons[0]
        request = _request("after-freeze", 3)
        if holding:
            cluster.hold(request, lease_s=60)
        time.sleep(0.5)  # the sweeps at their pace (every 0.2 s with a hold)
        os.kill(daemon.process.pid, signal.SIGSTOP)
        time.sleep(frozen_s)
        os.kill(daemon.process.pid, signal.SIGCONT)
        time.sleep(1.0)  # a maintenance tick or two, and the engine's next heartbeats
        assert _metric(daemon, "kvxferd_engines_registered") == 1
        assert "engine gone" not in daemon.tail(20000)
        completions = cluster.read(request, hold=not holding)
        assert all(c.ok for c in completions), [c.error for c in completions]
        assert cluster.verify(request) == ([], 0)


def test_a_deregistered_engines_nixl_agent_goes_at_once(workdir):
    """Found by the soak (no_leaks): each deregistered engine's NIXL agent (UCX worker, sockets, shared
    memory: about 9 fds) lived until some later full garbage collection, so restarts piled them up."""
    from kvxferd.client import DaemonProcess, SharedArena, engine_rank_pb
    from kvxferd.rig.daemons import usage
    from kvxferd.rig.verify.buffers import allocate_engine

    prefill_groups, decode_groups = _groups()
    daemons = DaemonProcess.start_many(["agents-p", "agents-d"], socket_dir=workdir)
    try:
        first = None  # what the daemons hold after the first engine came and went (its gRPC peers stay)
        for n in range(4):
            arenas = []
            def allocate(num_bytes):
                arenas.append(SharedArena(num_bytes))
                return arenas[-1].array
            caches = [allocate_engine(f"{side}{n}", groups, 1, 0, tagged=side == "p", allocate=allocate).cache
                      for side, groups in (("p", prefill_groups), ("d", decode_groups))]
            clients = [EngineClient(d.engine_target) for d in daemons]
            for client, cache, arena in zip(clients, caches, arenas):
                client.register(engine_rank_pb(cache, arena))
            prefill, decode = clients
            decode.handshake(f"p{n}", [daemons[0].peer_address])
            request = _request(f"agents{n}", n)
            held = prefill.hold(request.remote_request_id, request.remote_block_ids)
            decode.reads.submit_reads([decode.read_spec(request.request_id, f"p{n}", request.remote_request_id,
                                                  request.local_block_ids, request.remote_block_ids,
                                                  remote_capabilities=[held.capability])])
            assert decode.reads.wait_completion(request.request_id).ok
            for client in (decode, prefill):  # the reader leaves at once after its completion
                client.deregister()
                client.close()
            for arena in arenas:
                arena.close()
            # A deregistered engine's holds run out first (their readers report, or their leases end: issue
            # #60). The reader's CONSUMED notice is sent on before its agent goes (the data plane's
            # _flush_notices): without it, it died with the agent in about one of four rounds here, and the
            # holder kept the memory for its drain_timeout_s (10 s).
            # (Seen in /proc, not on the metrics endpoint: its connections would count among the fds.)
            ended_s = time.monotonic() + 2.0
            while usage(daemons[0].process.pid)["engine_shm"] and time.monotonic() < ended_s:
                time.sleep(0.02)
            assert not usage(daemons[0].process.pid)["engine_shm"], n  # the hold ended, the memory went
            give_up_s = time.monotonic() + 5.0
            while True:
                time.sleep(0.3)
                after = [usage(d.process.pid) for d in daemons]
                first = first or [u["fds"] for u in after]
                if ([u["fds"] for u in after] == first and [u["other_shm_mappings"] for u in after] == [0, 0]) \
                        or time.monotonic() > give_up_s:
                    break
            assert [u["fds"] for u in after] == first, (n, after)
            assert [u["other_shm_mappings"] for u in after] == [0, 0]
    finally:
        for daemon in daemons:
            daemon.terminate()


def test_an_engine_registers_again_by_itself_when_its_daemon_restarted(workdir):
    """A restarted daemon (same addresses) does not know the engine: the client's heartbeat hears
    NOT_FOUND and registers the same cache again; a read in flight then fails as lost, never hangs."""
    from kvxferd.client import DaemonProcess
    from kvxferd.client.engine import LostRead

    with DaemonCluster(*_groups(), 1, 1, workdir=workdir, name="again", lease_s=0.9) as cluster:
        decode = cluster.decode_clients[0]
        old = cluster.decode_daemons[0]
        request = _request("in-flight", 4)
        decode.reads._pending[request.request_id] = decode.read_spec(request.request_id, cluster.prefill_id,
                                                               request.remote_request_id, request.local_block_ids,
                                                               request.remote_block_ids)
        old.kill()
        port = old.peer_address.rsplit(":", 1)[1]
        cluster.daemons[1] = DaemonProcess(old.daemon_id, socket_dir=workdir, extra_args=("--peer-port", port))
        deadline = time.monotonic() + 10
        while decode.num_reregistrations == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode.num_reregistrations == 1
        assert _metric(cluster.decode_daemons[0], "kvxferd_engines_registered") == 1
        with pytest.raises(LostRead):
            decode.reads.wait_completion(request.request_id, timeout_s=5)
        cluster.handshake()
        cluster.reset_decode()
        completions = cluster.read(_request("after", 5))
        assert all(c.ok for c in completions), [c.error for c in completions]


def test_an_engine_that_left_holding_keeps_its_memory_until_the_hold_ends_and_its_id_waits(workdir):
    """Issue #60: an engine's Deregister with a hold open is answered at once; its memory stays mapped while
    the hold may be read (here until its 4 s lease ends: nobody reads it), a Register of the same id meanwhile
    is refused ALREADY_EXISTS (a restarting connector waits and retries on it), and once the hold ended the
    memory goes and the id registers again."""
    from kvxferd.client import DaemonProcess
    from kvxferd.rig.daemons import usage
    from tests.service.helpers import engine_pb

    lease_s = 4.0  # the hold's: the Deregister is answered well before it ends, the memory goes when it does
    prefill_groups, _ = _groups()
    (daemon,) = DaemonProcess.start_many(["retire-p"], socket_dir=workdir)
    arenas = []
    clients = []
    try:
        message = engine_pb(prefill_groups, "leaving", arenas, tagged=True)
        client = EngineClient(daemon.engine_target)
        clients.append(client)
        client.register(message)
        request = _request("retire", 0)
        client.hold(request.remote_request_id, request.remote_block_ids, lease_s=lease_s)
        start = time.monotonic()
        client.deregister()
        assert time.monotonic() - start < lease_s  # answered while the hold runs out, not when it ended
        assert usage(daemon.process.pid)["engine_shm"]  # still mapped: the hold may be being read
        again = EngineClient(daemon.engine_target)
        clients.append(again)
        with pytest.raises(grpc.RpcError) as refused:
            again.register(message)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS, refused.value.details()
        while usage(daemon.process.pid)["engine_shm"] and time.monotonic() - start < lease_s + 10:
            time.sleep(0.05)
        assert not usage(daemon.process.pid)["engine_shm"] and time.monotonic() - start >= lease_s - 0.5  # its lease
        again.register(message)  # the id is free again
    finally:
        for client in clients:
            client.close()
        daemon.terminate()
        for arena in arenas:
            arena.close()
