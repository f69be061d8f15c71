"""Issue 11, attacks 7 and 9: the engine socket, engine sessions and the fd socket.

* The sockets are created 0600 in a 0700 directory the daemon owns; the
  kernel refuses other users (checked as another uid when the tests run as root).
* Every engine call but Register carries the session Register returned: another
  local client cannot act as an engine, and a live engine id cannot be taken over.
* The fd socket checks the peer's uid, bounds each client's time, and survives
  clients that stall or vanish. So does the reads socket (an engine's read batches
  without gRPC), which also needs the session in its first batch.
"""

from __future__ import annotations

import os
import socket
import stat
import time

import grpc
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.client.fdsend import send_fds
from kvxferd.wire.names import fd_socket_path
from kvxferd.wire.frames import encode_frame, reads_socket_path
from kvxferd.rig.verify.models import ModelShape, model_groups
from tests.service.helpers import engine_pb, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
as_root = pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")


@pytest.fixture(scope="module")
def daemon(workdir):
    # No --engine-socket: the default private directory, here under a test XDG_RUNTIME_DIR.
    runtime = os.path.join(workdir, "xdg")
    os.mkdir(runtime, 0o700)
    process = DaemonProcess("sock", socket_dir=workdir, env={"XDG_RUNTIME_DIR": runtime}, default_socket=True)
    yield process
    process.terminate()


def test_sockets_are_private_to_the_daemons_user(daemon):
    path = daemon.engine_target.removeprefix("unix:")
    directory = os.path.dirname(path)
    assert directory.endswith("/xdg/kvxferd")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for sock in (path, fd_socket_path(path), reads_socket_path(path)):
        info = os.stat(sock)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, sock


def _connect_as(uid: int, path: str, payload: bytes | None = None) -> str:
    """Connect to ``path`` from a child running as ``uid``, and send ``payload`` if given; returns what
    happened ("connected", or with a payload "answered" / "closed"; else the error)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        outcome = b"connected"
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(5)
                conn.connect(path)
                if payload is not None:
                    conn.sendall(payload)
                    outcome = b"answered" if conn.recv(64) else b"closed"
        except PermissionError:
            outcome = b"EACCES"
        except OSError as err:
            outcome = type(err).__name__.encode()
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as result:
        return result.read().decode()


@as_root
def test_another_user_cannot_connect(daemon):
    path = daemon.engine_target.removeprefix("unix:")
    assert _connect_as(65534, path) == "EACCES"
    assert _connect_as(65534, fd_socket_path(path)) == "EACCES"
    assert _connect_as(65534, reads_socket_path(path)) == "EACCES"
    assert _connect_as(os.getuid(), path) == "connected"  # the control


def test_calls_need_the_engines_session(daemon, arenas):
    owner = EngineClient(daemon.engine_target)
    intruder = EngineClient(daemon.engine_target)
    try:
        owner.register(engine_pb(GROUPS[0], "tenant-a", arenas), lease_s=30)
        intruder.engine_id = "tenant-a"
        calls = {
            "Heartbeat": lambda: intruder.stub.Heartbeat(pb.HeartbeatRequest(engine_id="tenant-a")),
            "Hold": lambda: intruder.hold("r", [[1, 2]]),
            "Release": lambda: intruder.stub.Release(pb.ReleaseRequest(engine_id="tenant-a", request_id="r")),
            "RenewLease": lambda: intruder.renew(["r"]),
            "MissedEvents": lambda: intruder.missed_events(0),
            "Handshake": lambda: intruder.handshake("x", ["127.0.0.1:1"]),
            "Reads": lambda: list(intruder.stub.Reads(iter([pb.ReadBatch(engine_id="tenant-a")]), timeout=5)),
            "Deregister": lambda: intruder.stub.Deregister(pb.DeregisterRequest(engine_id="tenant-a")),
        }
        for name, call in calls.items():
            code, details = status(call)
            assert code == C.UNAUTHENTICATED and details.startswith("engine_id"), (name, code, details)
        intruder.session = "forged" + owner.session[6:]
        assert status(calls["Hold"])[0] == C.UNAUTHENTICATED
        owner.hold("r", [[1, 2]])  # the owner is unaffected
        # A release on a control session is not answered: the intruder's does nothing (the hold lives on).
        intruder.release("r")
        assert status(lambda: intruder.renew(["r"]))[0] == C.UNAUTHENTICATED  # its session was ended
        assert owner.renew(["r"], lease_s=30) == []
        owner.release("r")
        assert owner.renew(["r"], lease_s=30) == ["r"]  # the control: a release of the owner's ends it
    finally:
        owner.deregister()
        owner.close()
        intruder.close()


def test_a_live_engine_id_cannot_be_registered_again_by_someone_else(daemon, arenas):
    owner = EngineClient(daemon.engine_target)
    intruder = EngineClient(daemon.engine_target)
    try:
        first = owner.register(engine_pb(GROUPS[0], "tenant-b", arenas), lease_s=30)
        code, details = status(lambda: intruder.register(engine_pb(GROUPS[0], "tenant-b", arenas)))
        assert code == C.ALREADY_EXISTS and "alive" in details, details
        again = owner.register(engine_pb(GROUPS[0], "tenant-b", arenas), lease_s=30)  # its own session: replaced
        assert again.incarnation != first.incarnation and again.session != first.session
        owner.hold("r", [[3]])
    finally:
        owner.deregister()
        owner.close()
        intruder.close()


def test_a_new_registration_keeps_only_a_session_of_the_daemons_own_format(daemon, arenas):
    """A client registering again after a daemon restart presents its session and keeps it (its
    scheduler process holds with it); a made-up session never opens a live registration, and
    anything not of the daemon's format is replaced by a fresh one."""
    kept = "k" * 43  # the format of secrets.token_urlsafe(32)
    for presented, expect_kept in ((kept, True), ("short", False), ("k" * 42 + "!", False), ("", False)):
        client = EngineClient(daemon.engine_target)
        client.session = presented
        try:
            reply = client.register(engine_pb(GROUPS[0], "tenant-s", arenas), lease_s=30, heartbeat_s=0)
            assert (reply.session == presented) is expect_kept, presented
            assert len(reply.session) == 43
            if expect_kept:
                intruder = EngineClient(daemon.engine_target)
                intruder.session = "i" * 43  # well-formed, but not this live registration's
                code, details = status(lambda: intruder.register(engine_pb(GROUPS[0], "tenant-s", arenas)))
                assert code == C.ALREADY_EXISTS, details
                intruder.close()
        finally:
            client.deregister()
            client.close()


def test_an_expired_registration_may_be_taken_over(daemon, arenas):
    gone = EngineClient(daemon.engine_target)
    gone.register(engine_pb(GROUPS[0], "tenant-c", arenas), lease_s=0.5, heartbeat_s=0)  # never heartbeats
    gone.close()
    time.sleep(0.7)
    successor = EngineClient(daemon.engine_target)
    try:
        successor.register(engine_pb(GROUPS[0], "tenant-c", arenas), lease_s=30)
    finally:
        successor.deregister()
        successor.close()


def test_the_fd_socket_survives_stalled_and_vanishing_clients(daemon, arenas):
    path = fd_socket_path(daemon.engine_target.removeprefix("unix:"))
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(path)  # says nothing: the inbox gives up on it after fd_recv_timeout_s (2 s)
    vanishing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    vanishing.connect(path)
    socket.send_fds(vanishing, [b"gone"], [os.open("/dev/null", os.O_RDONLY)])
    vanishing.close()  # before the daemon's "ok": its answer meets a closed socket (BrokenPipe)
    start = time.monotonic()
    read_end, write_end = os.pipe()
    try:
        send_fds(path, "after", [read_end], timeout_s=10)  # still served, after at most the stalled client's timeout
        assert time.monotonic() - start < 8
        send_fds(path, "after-2", [write_end], timeout_s=10)
    finally:
        stalled.close()
        os.close(read_end)
        os.close(write_end)
    assert daemon.process.poll() is None


@as_root
def test_the_fd_socket_refuses_other_uids_even_when_reachable(daemon):
    path = fd_socket_path(daemon.engine_target.removeprefix("unix:"))
    directories = [os.path.dirname(path), os.path.dirname(os.path.dirname(path)), os.path.dirname(daemon.log_path)]
    for directory in directories:
        os.chmod(directory, 0o711)
    os.chmod(path, 0o666)  # as if an operator widened the modes: SO_PEERCRED still decides
    try:
        before = daemon.metric("kvxferd_fd_socket_refused_total", 'reason="uid"')
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(65534)
                send_fds(path, "intruder", [read_end], timeout_s=5)
                os._exit(0)
            except Exception:
                os._exit(1)
        _, code = os.waitpid(pid, 0)
        os.close(read_end)
        os.close(write_end)
        assert os.waitstatus_to_exitcode(code) == 1  # no "ok"
        assert daemon.metric("kvxferd_fd_socket_refused_total", 'reason="uid"') == before + 1
    finally:
        os.chmod(path, 0o600)
        for directory in directories:
            os.chmod(directory, 0o700)


@as_root
def test_the_reads_socket_refuses_other_uids_even_when_reachable(daemon, arenas):
    """Another user, even holding a live engine's session, gets nothing: the connection is closed before
    a byte of it is read (SO_PEERCRED), and counted."""
    owner = EngineClient(daemon.engine_target)
    owner.register(engine_pb(GROUPS[0], "tenant-r", arenas), lease_s=30)
    path = reads_socket_path(daemon.engine_target.removeprefix("unix:"))
    directories = [os.path.dirname(path), os.path.dirname(os.path.dirname(path)), os.path.dirname(daemon.log_path)]
    for directory in directories:
        os.chmod(directory, 0o711)
    os.chmod(path, 0o666)  # as if an operator widened the modes: SO_PEERCRED still decides
    metric = ("kvxferd_rpc_errors_total", 'code="PERMISSION_DENIED",method="ReadsSocket"')
    try:
        before = daemon.metric(*metric)
        hello = encode_frame(pb.ReadBatch(engine_id="tenant-r", session=owner.session).SerializeToString())
        outcome = _connect_as(65534, path, hello)  # the stolen session, from another uid
        assert outcome in ("closed", "ConnectionResetError", "BrokenPipeError"), outcome
        deadline = time.monotonic() + 5
        while daemon.metric(*metric) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.metric(*metric) == before + 1
        assert owner.reads.take_lost() == set() and owner.reads.stream_error is None  # the owner's session is untouched
    finally:
        os.chmod(path, 0o600)
        for directory in directories:
            os.chmod(directory, 0o700)
        owner.deregister()
        owner.close()
