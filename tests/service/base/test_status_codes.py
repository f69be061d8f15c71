"""Issue 40: every status code of docs/protocol.md's table, drawn from real daemons as an engine meets it.

The table is read from the doc: a code added there without a case here, or
a case whose code the table does not name, fails
:func:`test_the_table_and_the_cases_name_the_same_codes`. Each case is one
engine-side action and the code it must get; the ones that failed before
issue 40 say so.
"""

from __future__ import annotations

import pathlib
import re
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from tests.service.helpers import engine_pb, oversized_batch, refusal, second_completion_stream, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
PROTOCOL = pathlib.Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
ANSWER_S = 5.0
LIMITS = ("--max-lease-s", "60", "--max-deadline-s", "60", "--max-holds-per-engine", "3",
          "--max-message-bytes", "65536")


def table_codes(text: str | None = None) -> list[str]:
    """The codes in the first column of protocol.md's "Status codes" table (of ``text``), in order."""
    section = (text or PROTOCOL.read_text()).split("## Status codes", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.MULTILINE)


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="sc", daemon_args=LIMITS) as c:
        yield c


def other_engine(cluster, engine_id, arenas, groups=GROUPS[0], **register) -> EngineClient:
    """A second engine on the prefill daemon (closed by the caller)."""
    client = EngineClient(cluster.prefill_daemons[0].engine_target)
    client.register(engine_pb(groups, engine_id, arenas), **register)
    return client


# ---- one case per code: (code, what the message must contain) ---------------------------------------
def invalid_argument(cluster, arenas):
    prefill = cluster.prefill_clients[0]
    code, details = status(lambda: prefill.hold("sc-big", [[1_000_000]]))
    assert code == C.INVALID_ARGUMENT and details.startswith("block_ids[0]"), details
    # Over a fixed limit is INVALID_ARGUMENT naming the limit: retrying never helps (docs say why).
    code, details = status(lambda: prefill.hold("sc-long", [[1]], lease_s=61))
    assert code == C.INVALID_ARGUMENT and details.startswith("lease_s") and "max_lease_s (60 s)" in details, details
    request = random_request("sc-deadline", *GROUPS, 16, np.random.default_rng(3))
    decode = cluster.decode_clients[0]
    code, details = refusal(decode, request.request_id, cluster.prefill_id, "x", request.local_block_ids,
                            request.remote_block_ids, deadline_s=61)
    assert code == C.INVALID_ARGUMENT and "max_deadline_s (60 s)" in details, details
    return code


def failed_precondition(cluster, arenas):
    other = other_engine(cluster, "sc-headsize", arenas, model_groups("gqa", ModelShape(head_size=32))[0])
    try:
        code, details = status(lambda: cluster.decode_clients[0].handshake(
            "sc-headsize", [cluster.prefill_daemons[0].peer_address]))
        assert "compatibility_hash" in details, details
        return code
    finally:
        other.close()


def not_found(cluster, arenas):
    code, details = status(lambda: cluster.decode_clients[0].handshake(
        "sc-nobody", [cluster.prefill_daemons[0].peer_address]))  # the remote daemon's NOT_FOUND, passed on
    assert details.startswith("peer_addresses[0]") and ": NOT_FOUND: " in details, details
    return code


def unavailable(cluster, arenas):
    code, details = status(lambda: cluster.decode_clients[0].handshake(cluster.prefill_id, ["127.0.0.1:1"]))
    assert details.startswith("peer_addresses[0]"), details
    return code


def unauthenticated(cluster, arenas):
    stub = cluster.decode_clients[0].stub
    code, details = status(lambda: stub.Heartbeat(pb.HeartbeatRequest(engine_id=cluster.decode_id), timeout=ANSWER_S,
                                                  metadata=(("kvxferd-session", "not-the-session"),)))
    assert details.startswith("engine_id"), details
    return code


def permission_denied(cluster, arenas):
    """Before issue 40 the refused reader got UNAVAILABLE (the remote's PERMISSION_DENIED only in the text),
    and an engine retrying on UNAVAILABLE retried a permanent refusal forever."""
    guarded = other_engine(cluster, "sc-guarded", arenas, allowed_reader_engine_ids=["somebody-else"])
    try:
        code, details = status(lambda: cluster.decode_clients[0].handshake(
            "sc-guarded", [cluster.prefill_daemons[0].peer_address]))
        assert code == C.PERMISSION_DENIED and details.startswith("peer_addresses[0]"), (code, details)
        assert "PERMISSION_DENIED" in details and "reader_engine_id" in details, details
    finally:
        guarded.close()
    # a read without the hold's capabilities: refused before anything is posted
    request = random_request("sc-unsealed", *GROUPS, 16, np.random.default_rng(4))
    cluster.hold(request)
    decode = cluster.decode_clients[0]
    code, details = refusal(decode, request.request_id, cluster.prefill_id, request.remote_request_id,
                            request.local_block_ids, request.remote_block_ids)
    assert details.startswith("remote_capabilities"), details
    cluster.prefill_clients[0].release(request.remote_request_id)
    return code


def already_exists(cluster, arenas):
    stranger = EngineClient(cluster.decode_daemons[0].engine_target)  # not the decode engine's client: no session
    try:
        code, details = status(lambda: stranger.stub.Register(pb.RegisterRequest(
            engine=engine_pb(GROUPS[1], cluster.decode_id, arenas)), timeout=30))
    finally:
        stranger.close()
    assert details.startswith("engine.engine_id"), details
    return code


def resource_exhausted(cluster, arenas):
    prefill = cluster.prefill_clients[0]
    for i in range(3):
        prefill.hold(f"sc-many{i}", [[10 + i]])
    try:
        code, details = status(lambda: prefill.hold("sc-many3", [[20]]))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_holds_per_engine"), details
    finally:
        for i in range(3):
            prefill.release(f"sc-many{i}")
    # a batch over --max-message-bytes 65536 ends its session
    code, details = oversized_batch(cluster.decode_daemons[0].engine_target, GROUPS[1], arenas, "sc-huge")
    assert code == C.RESOURCE_EXHAUSTED, details
    return code  # max_concurrent_streams: test_a_call_past_max_concurrent_streams_is_answered_at_once


def aborted(cluster, arenas):
    code, details = second_completion_stream(cluster.decode_daemons[0].engine_target, "sc-streams", GROUPS[1], arenas,
                                             ANSWER_S)
    assert "replaced" in details, details
    return code


CASES = {"INVALID_ARGUMENT": invalid_argument, "FAILED_PRECONDITION": failed_precondition, "NOT_FOUND": not_found,
         "UNAVAILABLE": unavailable, "UNAUTHENTICATED": unauthenticated, "PERMISSION_DENIED": permission_denied,
         "ALREADY_EXISTS": already_exists, "RESOURCE_EXHAUSTED": resource_exhausted, "ABORTED": aborted}
NOT_FROM_OUTSIDE = {"INTERNAL"}  # a bug; test_fuzz_rpcs shows no bad input gets it


def test_the_table_and_the_cases_name_the_same_codes():
    codes = table_codes()
    assert len(codes) == len(set(codes)), codes
    assert set(codes) == set(CASES) | NOT_FROM_OUTSIDE
    assert all(code in C.__members__ for code in codes), codes


def test_the_table_reader_sees_a_missing_row():
    """Negative control: the reader is not blind; a row taken out of the table is missed."""
    text = PROTOCOL.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `ABORTED` |"))
    assert "ABORTED" in table_codes() and "ABORTED" not in table_codes(text.replace(row + "\n", ""))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_code_of_the_table_from_a_real_daemon(cluster, arenas, name):
    assert CASES[name](cluster, arenas).name == name
    # and nothing an engine did broke the daemons: a read still works, byte-exact
    request = random_request(f"sc-after-{name.lower()}", *GROUPS, 32, np.random.default_rng(len(name)))
    cluster.reset_decode()
    assert all(c.ok for c in cluster.read(request)), name
    assert cluster.verify(request) == ([], 0)


def _retry_until(call, give_up_s: float = 10.0):
    """``call()``'s result, or the last error once ``give_up_s`` passed (until the other streams run)."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return call()
        except grpc.RpcError as err:
            if time.monotonic() > deadline:
                return err
        time.sleep(0.05)


def test_a_call_past_max_concurrent_streams_is_answered_at_once(workdir, arenas):
    """Before issue 40 the call past the limit waited in the client's HTTP/2 queue: DEADLINE_EXCEEDED with a
    deadline, forever without one. Now it is RESOURCE_EXHAUSTED at once, naming the limit, and counted. The
    limit is per engine session: a stranger on the socket (no session) cannot use up an engine's calls, and
    the calls that keep its lease never count."""
    (daemon,) = DaemonProcess.start_many(["sc-streams"], socket_dir=workdir,
                                         extra_args=("--max-concurrent-streams", "1", "--lease-s", "3"))
    engine = EngineClient(daemon.engine_target, reads_socket=False)  # its session: one gRPC Reads stream
    stranger = grpc.insecure_channel(daemon.engine_target)
    stop = threading.Event()

    def nothing_until_stopped():  # a Reads request stream that sends nothing
        stop.wait()
        yield from ()
    try:
        # the engine opens its Reads stream: its one call runs
        engine.register(engine_pb(GROUPS[1], "sc-s0", arenas), heartbeat_s=0, lease_s=3)
        # a stranger's idle Reads stream (no session) fills the sessionless budget, and only that
        idle = engine_grpc.EngineServiceStub(stranger).Reads(nothing_until_stopped(), timeout=30)

        give_up_s = time.monotonic() + 10
        for attempt in range(10_000):  # admitted only until the engine's Reads stream runs on the daemon
            try:
                engine.hold(f"sc-more{attempt}", [[1, 2]])
            except grpc.RpcError as err:
                refused = err
                break
            engine.release(f"sc-more{attempt}")
            assert time.monotonic() < give_up_s, "the engine's stream never ran"
        assert refused.code() == C.RESOURCE_EXHAUSTED, refused
        assert refused.details().startswith("max_concurrent_streams") and "limit 1" in refused.details(), refused
        assert 'kvxferd_rpc_errors_total{code="RESOURCE_EXHAUSTED",method="Hold"}' in daemon.metrics_text()
        for _ in range(3):  # its lease is kept: Heartbeat is never refused (4 s > the 3 s lease)
            engine.stub.Heartbeat(pb.HeartbeatRequest(engine_id="sc-s0"), timeout=2)
            time.sleep(4 / 3)
        with grpc.insecure_channel(daemon.engine_target) as channel:  # probes are not counted
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        third = pb.RegisterRequest(engine=engine_pb(GROUPS[1], "sc-s2", arenas))
        code, details = status(lambda: engine_grpc.EngineServiceStub(stranger).Register(third, timeout=2))
        assert code == C.RESOURCE_EXHAUSTED and details.startswith("max_concurrent_streams"), details
        idle.cancel()  # the sessionless budget is free again
        reply = _retry_until(lambda: engine_grpc.EngineServiceStub(stranger).Register(third, timeout=2))
        assert isinstance(reply, pb.RegisterReply), reply
    finally:
        stop.set()
        engine.close()
        stranger.close()
        daemon.terminate()


def test_a_remote_refusing_this_daemons_credentials_is_permission_denied(cluster, workdir, tmp_path, arenas):
    """A remote of another host secret is about the daemons, not the engine's session: the engine gets
    PERMISSION_DENIED, which it does not retry (issue 40). Since issue 53 the dialling daemon finds it out
    first: the remote's challenge proof is not of this daemon's secret, and nothing more is sent."""
    secret = tmp_path / "another-host.secret"
    (stranger,) = DaemonProcess.start_many(["sc-other-host"], socket_dir=workdir,
                                           extra_args=("--peer-secret-file", str(secret)))
    client = EngineClient(stranger.engine_target)
    try:
        client.register(engine_pb(GROUPS[1], "sc-elsewhere", arenas))
        code, details = status(lambda: client.handshake(cluster.prefill_id, [cluster.prefill_daemons[0].peer_address]))
        assert code == C.PERMISSION_DENIED and "not this host's peer secret" in details, (code, details)
    finally:
        client.close()
        stranger.terminate()
