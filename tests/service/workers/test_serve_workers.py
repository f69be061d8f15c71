"""``kvxferd serve --dataplane-workers`` against real daemons (mutual TLS, UCX over TCP, real NIXL):
peers read the prefill rank through its worker, byte-exact and CONSUMED; the metadata an allowed peer gets
reaches none of the daemon's secrets (which the same search finds in the daemon itself); and a worker killed
by a READ of an unmapped address is replaced while the daemon keeps its holds."""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.attack.reach import NixlReach, read_state, search_process_memory
from kvxferd.rig.daemons import DaemonCluster, dataplane_workers
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent, TransferState, agent_name_of
from tests.security.conftest import SPIFFE, tls_args
from tests.sockets import listening_sockets

pytestmark = pytest.mark.daemons
GROUPS = model_groups("gqa", ModelShape())
RESTART_BOUND_S = 30.0  # a killed worker's successor serves reads within this (about 2-3 s here)


@pytest.fixture(scope="module")
def cluster(workdir, ca):
    issued = ca.issue("kvxferd", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    args = (*tls_args(ca, issued), "--peer-secret-file", f"{workdir}/peer.secret", "--dataplane-workers",
            "--dataplane-reader-workers")
    # The decode daemon reads over NIXL (never by opening the holder's memory itself); the prefill daemon
    # keeps same-host reads on, so it holds the host secret the search must not find in its worker.
    decode_over_nixl = lambda daemon_id: ("--no-same-host-reads",) if "-d" in daemon_id else ()  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", "tcp")  # as across hosts without RDMA: the lane where H1 holds
        with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="wk", daemon_args=args,
                            args_of=decode_over_nixl) as c:
            c.issued, c.secret_file = issued, f"{workdir}/peer.secret"
            yield c


def served_info(cluster, ca) -> pb.EngineInfo:
    """The prefill rank's engine info as an allowed peer gets it."""
    daemon, issued = cluster.prefill_daemons[0], cluster.issued
    credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(), issued.cert.read_bytes())
    reader = NixlAgent(f"wk-intro-{time.monotonic_ns()}")
    try:
        with grpc.secure_channel(daemon.peer_address, credentials,
                                 options=[("grpc.ssl_target_name_override", "kvxferd-peer")]) as channel:
            reply = peer_grpc.PeerServiceStub(channel).GetEngineInfo(pb.EngineInfoRequest(
                engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
                reader_engine_id="wk-attacker", reader_tp_rank=0, reader_tp_size=1,
                reader_agent_metadata=reader.metadata()), timeout=10)
    finally:
        reader.close()
    info = pb.EngineInfo()
    info.ParseFromString(reply.payload)
    return info


def worker_of(cluster, daemon=None) -> int:
    (pid,) = dataplane_workers((daemon or cluster.prefill_daemons[0]).process.pid, "holder")
    return pid


def read_until_ok(cluster, request, timeout_s: float) -> float:
    """Read ``request`` (held already) until a read ends ok; the seconds it took."""
    start = time.monotonic()
    while True:
        completions = cluster.read(request, timeout_s=20, hold=False)
        if all(c.ok for c in completions):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, [c.error for c in completions]
        time.sleep(0.2)


def test_peers_read_through_the_worker_byte_exact(cluster, ca):
    request = random_request("wk-ok", *GROUPS, 64, np.random.default_rng(0))
    cluster.reset_decode()  # verify() checks the whole decode cache against one request
    completions = cluster.read(request, timeout_s=20)
    assert all(c.ok for c in completions), [c.error for c in completions]
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]  # notices came via the worker


def test_the_metadata_a_peer_gets_reaches_no_secret_of_the_daemon(cluster, ca):
    needles = {"tls_key": cluster.issued.key.read_bytes().splitlines()[2],
               "host_secret": bytes.fromhex(open(cluster.secret_file).read().strip()),
               "session": next(c for c in cluster.clients if c.engine_id == cluster.prefill_id).session.encode()}
    in_daemon = search_process_memory(cluster.prefill_daemons[0].process.pid, needles)
    assert all(in_daemon.values()), f"the control: the daemon holds each secret ({in_daemon})"
    worker = worker_of(cluster)
    metadata = served_info(cluster, ca).agent_metadata
    reach = NixlReach(metadata)
    try:
        found, num_read = reach.search(worker, {**needles, "own name": agent_name_of(metadata).encode()})
    finally:
        reach.close()
    assert found.pop("own name"), "the widened READs reached the worker's heap (its agent's name is there)"
    assert found == {label: [] for label in needles}
    assert search_process_memory(worker, needles) == {label: [] for label in needles}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on."""
    return {port for _, port in listening_sockets(pid)}


def own_ports(daemon) -> set[int]:
    """The TCP ports a daemon was told to listen on (peer, notify, metrics; its engine socket is a path)."""
    return {int(address.rsplit(":", 1)[1].split("/")[0]) for name, address in daemon.addresses.items()
            if name != "engine"}


def test_the_engines_own_reads_run_in_a_reader_worker_and_the_daemon_keeps_no_nixl_agent(cluster):
    """The decode daemon's READs are posted by a reader worker: the worker holds none of the daemon's
    secrets (found in the daemon: the control), and the daemon listens on its own ports only, where every
    NIXL agent in it would listen on TCP for UCX (two ports each here: the control, a daemon without
    workers, is below)."""
    decode = cluster.decode_daemons[0]
    # (The decode daemon reads over NIXL only, so it never loads the host secret: not searched for.)
    needles = {"tls_key": cluster.issued.key.read_bytes().splitlines()[2],
               "session": next(c for c in cluster.clients if c.engine_id == cluster.decode_id).session.encode()}
    assert all(search_process_memory(decode.process.pid, needles).values()), "the control: the daemon holds each"
    (reader,) = dataplane_workers(decode.process.pid, "reader")
    assert search_process_memory(reader, needles) == {label: [] for label in needles}
    own = own_ports(decode)
    assert listening_ports(decode.process.pid) <= own, (listening_ports(decode.process.pid), own)
    assert listening_ports(reader) - own, "the reader worker's agent listens (UCX over TCP): it is where NIXL is"


def test_a_daemon_without_workers_listens_for_ucx_itself(tmp_path):
    """The control of the test above: without workers the daemon's own agents listen beside its ports."""
    with DaemonCluster(*GROUPS, 1, 1, workdir=str(tmp_path), name="wn") as c:
        daemon = c.decode_daemons[0]
        assert listening_ports(daemon.process.pid) - own_ports(daemon)


def test_a_reader_worker_that_dies_fails_its_reads_whole_and_the_next_generation_reads(cluster):
    """The reader worker killed: reads sent meanwhile fail with every block invalid (the engine
    recomputes), nothing is lost on the holder's side, and once the next generation is up the link
    handshakes again and reads byte-exact, the hold ending CONSUMED."""
    decode = cluster.decode_daemons[0]
    (first,) = dataplane_workers(decode.process.pid, "reader")
    deaths = decode.metric("kvxferd_dataplane_worker_deaths_total")
    os.kill(first, signal.SIGKILL)
    request = random_request("wk-reader-dies", *GROUPS, 64, np.random.default_rng(4))
    cluster.reset_decode()
    completions = cluster.read(request, timeout_s=20)
    for c in completions:  # sent while no reader worker is up: failed whole (or ok once the next one is)
        assert c.ok or sorted(np.concatenate([b.ids for b in c.invalid_block_ids]).tolist()) == sorted(
            np.concatenate([np.asarray(ids) for ids in request.local_block_ids]).tolist()), c
    # A first read that ended ok consumed the hold (the next generation was up in time): nothing to retry.
    took_s = 0.0 if all(c.ok for c in completions) else read_until_ok(cluster, request, RESTART_BOUND_S)
    (second,) = dataplane_workers(decode.process.pid, "reader")
    assert second != first and decode.process.poll() is None
    assert decode.metric("kvxferd_dataplane_worker_deaths_total") == deaths + 1
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]
    print(f"the first ok read after the reader worker died: {took_s:.2f} s; first try: "
          f"{[c.ok for c in completions]}")
    # Once its successor is up, the first read is ok: the death marked every link stale, so that read
    # handshakes with the new generation first (not: fails on a connection that died with the worker).
    log_at = decode.log_bytes()
    os.kill(second, signal.SIGKILL)
    deadline = time.monotonic() + RESTART_BOUND_S
    while "-r generation 3 (pid" not in decode.log_text(log_at) and time.monotonic() < deadline:  # up
        time.sleep(0.05)
    again = random_request("wk-reader-again", *GROUPS, 64, np.random.default_rng(5))
    cluster.reset_decode()
    completions = cluster.read(again, timeout_s=20)
    assert all(c.ok for c in completions), [c.error for c in completions]
    assert cluster.verify(again) == ([], 0)


def test_a_worker_killed_through_its_metadata_is_replaced_and_no_hold_is_lost(cluster, ca):
    request = random_request("wk-crash", *GROUPS, 64, np.random.default_rng(1))
    cluster.reset_decode()
    cluster.hold(request)  # held before the crash; read after it
    first = worker_of(cluster)
    deaths = cluster.prefill_daemons[0].metric("kvxferd_dataplane_worker_deaths_total")
    assert read_state(served_info(cluster, ca).agent_metadata, 0x10000, 4096) is TransferState.ERR
    deadline = time.monotonic() + RESTART_BOUND_S
    while first in dataplane_workers(cluster.prefill_daemons[0].process.pid, "holder") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first not in dataplane_workers(cluster.prefill_daemons[0].process.pid, "holder")
    assert cluster.prefill_daemons[0].process.poll() is None  # the daemon lives on
    took_s = read_until_ok(cluster, request, RESTART_BOUND_S)
    assert worker_of(cluster) != first
    assert cluster.prefill_daemons[0].metric("kvxferd_dataplane_worker_deaths_total") >= deaths + 1
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]  # the hold outlived it
    print(f"a read after the worker's death was ok {took_s:.2f} s after it died")


def wait_for_generation(daemon, generation: int) -> None:
    needle = f"-w generation {generation} (pid"  # the holder worker's (a reader worker's name ends -r)
    deadline = time.monotonic() + RESTART_BOUND_S
    while needle not in daemon.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert needle in daemon.log_text()


def test_readers_notice_a_new_holder_worker_by_its_incarnation_before_they_read(cluster, ca):
    """The incarnation peers are given names the worker's generation: the readers' probes (every
    peer_check_s, 2 s) see a new worker and handshake again, so the first read after it is ok. Without the
    generation in it that read goes to the dead worker's agent and fails."""
    prefill, decode = cluster.prefill_daemons[0], cluster.decode_daemons[0]
    before = served_info(cluster, ca).incarnation
    generation = 1 + prefill.log_text().count(") is up after")  # one engine rank: one worker
    first = worker_of(cluster)
    handshakes = decode.log_text().count('"handshake done"')
    os.kill(first, signal.SIGKILL)
    wait_for_generation(prefill, generation + 1)
    # A probe may come while no worker is up (its re-handshake is then refused): the next probe tries again.
    deadline = time.monotonic() + RESTART_BOUND_S
    while decode.log_text().count('"handshake done"') == handshakes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.log_text().count('"handshake done"') > handshakes, "no probe saw the new worker"
    request = random_request("wk-probed", *GROUPS, 64, np.random.default_rng(3))
    cluster.reset_decode()
    completions = cluster.read(request, timeout_s=20)
    assert all(c.ok for c in completions), [c.error for c in completions]  # the first read, not a retry
    assert cluster.verify(request) == ([], 0)
    registration = next(c for c in cluster.clients if c.engine_id == cluster.prefill_id).incarnation
    assert (before, served_info(cluster, ca).incarnation) == (f"{registration}.w{generation}",
                                                               f"{registration}.w{generation + 1}")


def test_a_readers_worker_that_dies_introduces_its_new_notice_agent(cluster):
    """The decode daemon's notices go out from its worker's notice agent; a new generation has a new one,
    which holders count only once it was introduced: every link of the reader handshakes again. Without
    that, its notices would be dropped as foreign and the hold would end EXPIRED, not CONSUMED."""
    decode = cluster.decode_daemons[0]
    first = worker_of(cluster, decode)
    os.kill(first, signal.SIGKILL)
    # Up, not just started: a read that ends while no worker is up has its notices dropped (its hold ends
    # EXPIRED at its lease; docs/dataplane.md).
    wait_for_generation(decode, 2)
    assert worker_of(cluster, decode) != first
    request = random_request("wk-reader", *GROUPS, 64, np.random.default_rng(2))
    cluster.reset_decode()
    cluster.hold(request)
    read_until_ok(cluster, request, RESTART_BOUND_S)
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def test_deregistering_a_served_engine_stops_its_worker_and_closes_its_files(tmp_path):
    with DaemonCluster(*GROUPS, 1, 1, workdir=str(tmp_path), name="wd", daemon_args=("--dataplane-workers",)) as c:
        daemon = c.prefill_daemons[0]
        worker = worker_of(c)
        assert board_fds(daemon.process.pid) == 3  # the board's, its mapping's own copy, the worker's read-only one
        next(client for client in c.clients if client.engine_id == c.prefill_id).deregister()
        deadline = time.monotonic() + 10
        while (dataplane_workers(daemon.process.pid) or board_fds(daemon.process.pid) > 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The board's fd and the worker's copy are closed; the mapping's own copy goes with the last view of
        # the board (the slot's hold table), when the slot is collected.
        assert dataplane_workers(daemon.process.pid) == [] and board_fds(daemon.process.pid) <= 1
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
        assert daemon.process.poll() is None
        assert daemon.metric("kvxferd_dataplane_worker_deaths_total") == 0  # asked to end: not a death


def board_fds(pid: int) -> int:
    """How many of ``pid``'s descriptors are a hold board's memfd."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += "kvxferd-hold-board" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return count


def test_a_rank_whose_worker_cannot_start_again_takes_the_peer_service_out_of_serving(tmp_path):
    """A worker is started again after each death unless its memory will not map (the engine's file
    shrank): then the PeerService health (the chart's readiness probe) says NOT_SERVING, the gauge counts
    the rank, and both clear once that engine deregisters. The daemon itself ("") keeps serving."""
    from kvxferd.client.health import check
    from kvxferd.service.daemon import PEER_SERVICE

    with DaemonCluster(*GROUPS, 1, 1, workdir=str(tmp_path), name="wg", daemon_args=("--dataplane-workers",)) as c:
        daemon = c.prefill_daemons[0]
        worker, target = worker_of(c), daemon.engine_target
        assert check(target, PEER_SERVICE) == "SERVING"
        with open(f"/proc/{worker}/maps") as maps:
            mapped = maps.read()
        (arena,) = [a for a in c.arenas if f"/dev/shm/{a.name}" in mapped]
        os.truncate(f"/dev/shm/{arena.name}", 0)  # no generation can map it again
        os.kill(worker, signal.SIGKILL)

        def until(predicate, timeout_s: float = 20.0) -> bool:
            deadline = time.monotonic() + timeout_s
            while not predicate() and time.monotonic() < deadline:
                time.sleep(0.1)
            return predicate()

        assert until(lambda: daemon.metric("kvxferd_dataplane_workers_given_up") == 1)
        assert until(lambda: check(target, PEER_SERVICE) == "NOT_SERVING")
        assert check(target) == "SERVING"  # its engines are still served: only peers are turned away
        next(client for client in c.clients if client.engine_id == c.prefill_id).deregister()
        assert until(lambda: check(target, PEER_SERVICE) == "SERVING")
        assert daemon.metric("kvxferd_dataplane_workers_given_up") == 0 and daemon.process.poll() is None
