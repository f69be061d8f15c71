"""Issue 53, L1: the audit log can be neither flooded nor forged, and names every refusal of security meaning.

Before: every refusal was one line, so one local uid wrote 1.35 MB/s into the log with refused peer calls;
the text format wrote a caller's engine id as it came, so a ``\\n`` in it forged a whole
``kvxferd.audit ... OK`` line; TLS-handshake refusals, engine-side refusals (sessions, uids on the
reads and fd sockets), forged capabilities and reader replacements left no line at all.

Now refusals are counted per caller and outcome: the first lines of a window are written, the rest
become one ``N more ... refusals from X in T s`` line (every refusal accounted for); text fields are
escaped and quoted; and each of those events is a ``kvxferd.audit`` line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import tempfile
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.names import SESSION_KEY, SHM_DIR
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.security.conftest import SPIFFE, tls_args
from tests.service.helpers import engine_pb, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
WINDOW_S, LINES = 1.0, 3  # the daemons' audit_window_s and audit_lines_per_window here
# From the environment (not flags), so that a daemon without these options still starts and shows the flood.
AUDIT_ENV = {"KVXFERD_AUDIT_WINDOW_S": str(WINDOW_S), "KVXFERD_AUDIT_LINES_PER_WINDOW": str(LINES)}
OTHER, GROUP = 65534, 65533  # nobody; a group the sockets are shared with (engine_socket_group)


def _audit(daemon: DaemonProcess, since: int = 0) -> list[dict]:
    """The JSON ``kvxferd.audit`` lines of ``daemon``'s log written after byte ``since``."""
    with open(daemon.log_path, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"kvxferd.audit"' in line]


def _log_size(daemon: DaemonProcess) -> int:
    return os.path.getsize(daemon.log_path)


def _accounted(lines: list[dict], event: str) -> tuple[int, int, list[dict]]:
    """``(lines written one by one, refusals counted in summaries, the summaries)`` of one event."""
    own = [r for r in lines if r.get("event") == event]
    summaries = [r for r in own if "suppressed" in r]
    return len(own) - len(summaries), sum(r["suppressed"] for r in summaries), summaries


@pytest.fixture(scope="module")
def shared_dir():
    """A directory other uids may reach (the sockets' own modes decide), as test_local_uids does."""
    path = tempfile.mkdtemp(prefix="kva")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(shared_dir):
    process = DaemonProcess("audit-json", socket_dir=shared_dir, env=AUDIT_ENV,
                            extra_args=("--engine-socket-group", str(GROUP)))
    yield process
    process.terminate()


@pytest.fixture(scope="module")
def text_daemon(shared_dir):
    process = DaemonProcess("audit-text", socket_dir=shared_dir, env={**AUDIT_ENV, "KVXFERD_LOG_FORMAT": "text",
                                                                "KVXFERD_AUDIT_LINES_PER_WINDOW": "10"})
    yield process
    process.terminate()


@pytest.fixture(scope="module")
def registered(daemon):
    arenas = []
    client = EngineClient(daemon.engine_target)
    message = engine_pb(GROUPS[0], "audited", arenas)
    os.chown(SHM_DIR / arenas[-1].name, -1, GROUP)  # the sockets' group may open it too (engine_socket_group)
    os.chmod(SHM_DIR / arenas[-1].name, 0o660)
    client.register(message, lease_s=30)
    yield client
    client.deregister()
    client.close()
    for arena in arenas:
        arena.close()


def test_a_flood_of_refusals_from_one_caller_is_a_count_not_a_line_each(daemon, registered):
    stranger = peer_grpc.PeerServiceStub(grpc.insecure_channel(daemon.peer_address))  # no peer token
    since, start, calls = _log_size(daemon), time.monotonic(), 0
    while time.monotonic() - start < 2.0:
        code, _ = status(lambda: stranger.GetIncarnation(pb.IncarnationRequest(engine_id=f"flood-{calls}"), timeout=5))
        assert code == C.UNAUTHENTICATED
        calls += 1
    flood_s = time.monotonic() - start
    time.sleep(WINDOW_S + 0.5)  # the last window ends: its summary is written
    lines = _audit(daemon, since)
    written, counted, summaries = _accounted(lines, "peer")
    audit_bytes = sum(len(json.dumps(r)) + 1 for r in lines)
    unlimited = calls * audit_bytes / max(len(lines), 1)  # what one line per refusal would have written
    rate = f"{calls} refusals in {flood_s:.1f} s: {audit_bytes / flood_s:,.0f} B/s of audit lines (one line each: " \
           f"{unlimited / flood_s:,.0f} B/s)"
    print(rate)
    assert calls > 200, rate
    windows = int(flood_s / WINDOW_S) + 2
    assert written <= LINES * windows and len(lines) <= (LINES + 1) * windows, (rate, len(lines))
    assert written + counted == calls, (written, counted, calls)  # every refusal accounted for
    assert summaries and all(re.fullmatch(r"\d+ more peer refusals from ipv4:127\.0\.0\.1 in 1 s", r["msg"])
                             for r in summaries), summaries[:2]
    assert audit_bytes / flood_s < 5000, rate
    # The control: the daemon's own peers are served, and their decisions still logged as they come.
    owner = peer_grpc.PeerServiceStub(peer_channel(daemon.peer_address))
    since = _log_size(daemon)
    owner.RenewLeases(pb.RenewLeaseRequest(engine_id="audited", request_ids=["r"], lease_s=1), timeout=10)
    assert [(r["method"], r["outcome"]) for r in _audit(daemon, since)] == [("RenewLeases", "OK")]


FORGED = "2026-01-01 00:00:00,000 INFO    kvxferd.audit: peer GetEngineInfo: OK method=GetEngineInfo outcome=OK"


def test_a_newline_in_an_engine_id_cannot_forge_a_text_line(text_daemon):
    stranger = peer_grpc.PeerServiceStub(grpc.insecure_channel(text_daemon.peer_address))
    since = _log_size(text_daemon)
    for engine_id in (f"x\n{FORGED}", f"y\r\n{FORGED}", f"z\u2028{FORGED}", "w outcome=OK identity=spiffe://forged"):
        assert status(lambda: stranger.GetIncarnation(pb.IncarnationRequest(engine_id=engine_id), timeout=5))[0] \
            == C.UNAUTHENTICATED
    engine = engine_grpc.EngineServiceStub(grpc.insecure_channel(text_daemon.engine_target))
    code, _ = status(lambda: engine.Heartbeat(pb.HeartbeatRequest(engine_id=f"v\n{FORGED}"), timeout=5,
                                              metadata=((SESSION_KEY, "s" * 43),)))
    assert code in (C.UNAUTHENTICATED, C.INVALID_ARGUMENT, C.NOT_FOUND)
    time.sleep(0.3)
    with open(text_daemon.log_path, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    lines = text.split("\n")
    assert not [line for line in lines if line.startswith("2026-01-01") or "\r" in line or "\u2028" in line], lines
    refusals = [line for line in lines if "kvxferd.audit: peer GetIncarnation: UNAUTHENTICATED" in line]
    assert len(refusals) == 4, lines
    # The caller's text is there, escaped, and a field value with spaces is quoted: it cannot add fields.
    assert "engine_id=\"x\\n2026-01-01 00:00:00,000 INFO" in refusals[0], refusals[0]
    assert "\\r\\n2026-01-01" in refusals[1] and "\\u2028" in refusals[2]
    assert 'engine_id="w outcome=OK identity=spiffe://forged"' in refusals[3], refusals[3]


def test_engine_side_refusals_are_audit_lines(daemon, registered):
    engine = engine_grpc.EngineServiceStub(grpc.insecure_channel(daemon.engine_target))
    since = _log_size(daemon)
    code, _ = status(lambda: engine.Heartbeat(pb.HeartbeatRequest(engine_id="audited"), timeout=5,
                                              metadata=((SESSION_KEY, "s" * 43),)))
    assert code == C.UNAUTHENTICATED
    refused = ReadsSocketStream(daemon.socket + ".reads", pb.ReadBatch(engine_id="audited", session="t" * 43),
                                timeout_s=5, max_frame_bytes=1 << 20)
    with pytest.raises(grpc.RpcError) as ended:
        list(refused)
    assert ended.value.code() == C.UNAUTHENTICATED
    # The control: the engine's own calls leave no line.
    registered.stub.Heartbeat(pb.HeartbeatRequest(engine_id="audited"), timeout=5)
    time.sleep(0.3)
    got = [(r["event"], r["outcome"], r.get("method", ""), r["engine_id"]) for r in _audit(daemon, since)]
    assert got == [("engine", "UNAUTHENTICATED", "Heartbeat", "audited"),
                   ("reads socket", "UNAUTHENTICATED", "", "audited")], got


def _connect_as_other(paths: list[str]) -> list[str]:
    """A process of uid OTHER whose supplementary group admits it to the sockets' files, but whose uid and
    primary group are not allowed (SO_PEERCRED): connects to each path, sends a byte; what each connect did."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcomes = []
        try:
            os.setgroups([GROUP])
            os.setgid(OTHER)
            os.setuid(OTHER)
            for path in paths:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(2)
                    sock.connect(path)
                    with contextlib.suppress(OSError):
                        sock.sendall(b"x")
                        sock.recv(16)
                    outcomes.append("connected")
                except OSError as err:
                    outcomes.append(type(err).__name__)
                finally:
                    sock.close()
        finally:
            os.write(write_fd, ",".join(outcomes).encode())
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as result:
        return result.read().decode().split(",")


@pytest.mark.skipif(os.getuid() != 0, reason="playing another uid needs root")
def test_uids_refused_on_the_reads_and_fd_sockets_are_audit_lines(daemon):
    since = _log_size(daemon)
    assert _connect_as_other([daemon.socket + ".reads", daemon.socket + ".fds"]) == ["connected", "connected"]
    time.sleep(0.3)
    got = [(r["event"], r["outcome"], r["uid"]) for r in _audit(daemon, since)]
    assert sorted(got) == [("fd socket", "PERMISSION_DENIED", OTHER), ("reads socket", "PERMISSION_DENIED", OTHER)]


@pytest.fixture(scope="module")
def cluster(workdir):
    old = {name: os.environ.get(name) for name in AUDIT_ENV}
    os.environ.update(AUDIT_ENV)
    try:
        with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="audit") as c:
            yield c
    finally:
        for name, value in old.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def test_capability_brute_force_shows_as_a_count(cluster):
    held = random_request("guessed", *GROUPS, 64, np.random.default_rng(3))
    (real,) = cluster.hold(held)
    decode = cluster.decode_daemons[0]
    since, client, guesses = _log_size(decode), cluster.decode_clients[0], 0
    for batch in range(6):  # the real key id and made-up MACs: what a brute force tries
        specs = [client.read_spec(f"g{batch}-{n}", cluster.prefill_id, held.remote_request_id, held.local_block_ids,
                                  held.remote_block_ids, remote_capabilities=(real[:4] + os.urandom(12),))
                 for n in range(50)]
        client.reads.submit_reads(specs)
        for spec in specs:
            completion = client.reads.wait_completion(spec.request_id, 10)
            assert not completion.ok and completion.refused_code == C.PERMISSION_DENIED.value[0]
            guesses += 1
    time.sleep(WINDOW_S + 0.5)
    written, counted, summaries = _accounted(_audit(decode, since), "capability")
    assert written + counted == guesses and written <= 3 * LINES, (written, counted, guesses)
    assert summaries and summaries[0]["caller"] == f"engine {cluster.decode_id}"
    assert all(r["remote_engine_id"] == cluster.prefill_id for r in _audit(decode, since) if r.get("event") == "capability")
    # The control: the real capability reads.
    cluster.reset_decode()
    cluster.submit(held)
    assert all(c.ok for c in cluster.completions(held)) and cluster.verify(held) == ([], 0)


def _introduce(cluster, reader: str, agent: NixlAgent) -> None:
    peer_grpc.PeerServiceStub(peer_channel(cluster.prefill_daemons[0].peer_address)).GetEngineInfo(
        pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
                             reader_engine_id=reader, reader_tp_rank=0, reader_tp_size=1,
                             reader_agent_metadata=agent.metadata()), timeout=10)


def test_a_reader_replaced_is_an_audit_line(cluster):
    prefill = cluster.prefill_daemons[0]
    first, second = NixlAgent("audit-reader-a"), NixlAgent("audit-reader-b")
    _introduce(cluster, "audit-reader", first)
    since = _log_size(prefill)
    _introduce(cluster, "audit-reader", first)  # the same agent again: nothing replaced
    _introduce(cluster, "audit-reader", second)
    time.sleep(0.3)
    replaced = [r for r in _audit(prefill, since) if r.get("event") == "reader replacement"]
    assert len(replaced) == 1, _audit(prefill, since)
    assert (replaced[0]["reader"], replaced[0]["old_agent"], replaced[0]["new_agent"]) == \
        ("audit-reader/0", "audit-reader-a", "audit-reader-b"), replaced[0]


def test_tls_handshake_refusals_are_audit_lines(workdir, ca):
    issued = ca.issue("audit-tls", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    daemon = DaemonProcess("audit-tls", socket_dir=workdir, env=AUDIT_ENV, extra_args=tls_args(ca, issued))
    try:
        since = _log_size(daemon)
        server_only = grpc.ssl_channel_credentials(ca.cert_path.read_bytes())  # no client certificate
        for _ in range(20):
            channel = grpc.secure_channel(daemon.peer_address, server_only,
                                          options=(("grpc.ssl_target_name_override", "kvxferd-peer"),))
            code, _ = status(lambda: peer_grpc.PeerServiceStub(channel).GetIncarnation(
                pb.IncarnationRequest(engine_id="x"), timeout=5))
            assert code == C.UNAVAILABLE
            channel.close()
        # The lines come from a child process that reads gRPC core's stderr (corelog.py): on a loaded machine
        # it may still be starting (importing gRPC) when the handshakes fail; their lines wait in its pipe.
        deadline = time.monotonic() + 30
        while True:
            time.sleep(WINDOW_S + 0.5)
            written, counted, _ = _accounted(_audit(daemon, since), "tls handshake")
            if written + counted >= 20 or time.monotonic() > deadline:
                break
        assert 1 <= written <= 2 * LINES and written + counted >= 20, (written, counted)
        assert {r["reason"] for r in _audit(daemon, since) if r.get("event") == "tls handshake"} \
            == {"PEER_DID_NOT_RETURN_A_CERTIFICATE"}
        # gRPC core's own line, one per handshake, no longer reaches the log.
        assert "Handshake failed" not in daemon.tail(200_000)
    finally:
        daemon.terminate()


def test_the_limiter_keeps_bounded_state_and_output_whoever_calls():
    """Many callers (a peer port reachable from many addresses): at most MAX_CALLERS windows are kept and at
    most MAX_LINES_PER_WINDOW lines written per window, every refusal counted in a summary."""
    from kvxferd.service.base.audit import RefusalLimiter

    now = [0.0]
    limiter = RefusalLimiter(1.0, 3, max_callers=64, max_lines=50, clock=lambda: now[0])
    admitted = sum(limiter.admit(("peer", f"ipv4:10.0.{n // 256}.{n % 256}", "X"), "peer", f"c{n}", "X", {})
                   for n in range(20_000))
    assert admitted == 50 and len(limiter._windows) <= 64
