"""Issue 35, local users: whom an engine talks to, and what a daemon opens for whom.

* An engine sends its session, memory handles and fds only to a daemon of the expected uid (its
  own unless told): the gRPC socket is judged by its file and directory, the reads and fd sockets by
  ``SO_PEERCRED``. Before, a socket of another user in the daemon's place got all of it.
* A shm object named in ``Register`` is opened with the daemon's credentials, so only for an object
  every user who could have sent it could open itself. Before, with ``engine_socket_group``, a member
  named a root-only object of a root daemon (and could read it over NIXL); over ``engine_tcp`` any
  token holder could. The default configuration admits no other user at all (shown too).

Another uid is played by a forked child (the tests run as root): ``setuid`` then raw sockets only.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import tempfile
import time

import grpc
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.errors import PermissionDeniedError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.client.fdsend import send_fds
from kvxferd.wire.names import SHM_DIR
from kvxferd.rig.verify.models import ModelShape, model_groups
from tests.security.conftest import SPIFFE, tls_args
from tests.service.helpers import engine_pb, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
OTHER = 65534  # nobody / nogroup
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="playing another uid needs root")


def _become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _pump(listeners: list[socket.socket], conns: list[socket.socket], stop_fd: int, on_data, *,
          end_on_eof: bool) -> None:
    """Accept on ``listeners`` and read ``conns`` (``on_data(sock, data)``) until ``stop_fd`` ends (or,
    with ``end_on_eof``, a connection does)."""
    conns = list(conns)
    while True:
        readable, _, _ = select.select([stop_fd, *listeners, *conns], [], [], 30)
        if not readable or stop_fd in readable:
            return
        for sock in readable:
            if sock in listeners:
                conns.append(sock.accept()[0])
                continue
            data = sock.recv(65536)
            if data:
                on_data(sock, data)
            elif end_on_eof:
                return
            else:
                conns.remove(sock)
                sock.close()


@contextlib.contextmanager
def _impostor(directory: str, names: tuple[str, ...]):
    """A process of uid OTHER listening on ``directory/<name>``; yields a dict filled, when the block
    ends, with the bytes each socket received."""
    received = {name: 0 for name in names}
    stop_r, stop_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        counts = dict.fromkeys(names, 0)
        try:
            os.close(stop_w)
            _become(OTHER)
            listeners = {}
            for name in names:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(os.path.join(directory, name))
                listener.listen(8)
                listeners[listener] = name
            os.write(ready_w, b"r")
            owners: dict = {}

            def count(sock, data):
                counts[owners.setdefault(sock, _name_of(sock, listeners))] += len(data)

            _pump(list(listeners), [], stop_r, count, end_on_eof=False)
        finally:
            os.write(ready_w, repr(counts).encode())
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"r"
    try:
        yield received
    finally:
        os.close(stop_w)
        os.waitpid(pid, 0)
        with os.fdopen(ready_r, "rb") as result:
            received.update(eval(result.read().decode()))  # noqa: S307 - our own child's repr of a dict
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def _name_of(conn: socket.socket, listeners: dict) -> str:
    path = conn.getsockname()
    return next(name for listener, name in listeners.items() if listener.getsockname() == path)


@pytest.fixture
def open_dir():
    """A directory every uid may create sockets in (root's, as /tmp is)."""
    path = tempfile.mkdtemp(prefix="kvu")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_engine_sends_nothing_to_another_users_sockets(open_dir):
    sock = os.path.join(open_dir, "kv.sock")
    arenas, fd = [], os.open("/dev/null", os.O_RDONLY)
    try:
        with _impostor(open_dir, ("kv.sock", "kv.sock.reads", "kv.sock.fds")) as received:
            client = EngineClient(f"unix:{sock}", timeout_s=2)
            with pytest.raises(PermissionDeniedError, match=f"uid {OTHER}"):
                client.register(engine_pb(GROUPS[0], "tenant-u", arenas))
            client.close()
            with pytest.raises(PermissionDeniedError, match=f"uid {OTHER}"):
                send_fds(sock + ".fds", "token", [fd], timeout_s=2)
            with pytest.raises(PermissionDeniedError, match=f"uid {OTHER}"):
                ReadsSocketStream(sock + ".reads", pb.ReadBatch(engine_id="tenant-u", session="s" * 43),
                                  timeout_s=2, max_frame_bytes=1 << 20)
        assert received == {"kv.sock": 0, "kv.sock.reads": 0, "kv.sock.fds": 0}
        # The control: told that the daemon runs as that user, the client does talk to it.
        with _impostor(open_dir, ("kv.sock", "kv.sock.fds")) as received:
            client = EngineClient(f"unix:{sock}", timeout_s=1, daemon_uid=OTHER)
            assert status(lambda: client.register(engine_pb(GROUPS[0], "tenant-u", arenas)))[0] == C.DEADLINE_EXCEEDED
            client.close()
            with pytest.raises(OSError):  # no "ok" from the impostor
                send_fds(sock + ".fds", "token", [fd], timeout_s=1, daemon_uid=OTHER)
        assert received["kv.sock"] > 0 and received["kv.sock.fds"] > 0, received
    finally:
        os.close(fd)
        for arena in arenas:
            arena.close()


def test_a_daemon_socket_in_another_users_directory_is_refused(open_dir):
    directory = os.path.join(open_dir, "theirs")
    os.mkdir(directory, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(directory, "kv.sock"))  # our own socket, but they may swap it at any time
    listener.listen(1)
    os.chown(directory, OTHER, OTHER)
    client = EngineClient(f"unix:{directory}/kv.sock", timeout_s=1)
    try:
        with pytest.raises(PermissionDeniedError, match=f"directory .* uid {OTHER}"):
            client.register(pb.EngineRank(engine_id="tenant-d", tp_size=1))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        client.close()
        listener.close()


@contextlib.contextmanager
def _relay_as(uid: int, target: str):
    """A process of ``uid`` connects to ``target`` and relays a root-private socket to it: yields
    ``(path to dial, what its connect did: "connected" or the error)``."""
    relay_dir = tempfile.mkdtemp(prefix="kvr")
    path = os.path.join(relay_dir, "relay.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    stop_r, stop_w = os.pipe()
    outcome_r, outcome_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(stop_w)
            _become(uid)
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(target)
            except OSError as err:
                os.write(outcome_w, b"EACCES" if isinstance(err, PermissionError) else type(err).__name__.encode())
                os._exit(0)
            os.write(outcome_w, b"connected")
            conn = listener.accept()[0]
            _pump([], [conn, upstream], stop_r, lambda sock, data: (upstream if sock is conn else conn).sendall(data),
                  end_on_eof=True)
        finally:
            os._exit(0)
    listener.close()
    os.close(outcome_w)
    try:
        yield path, os.read(outcome_r, 64).decode()
    finally:
        os.close(stop_w)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(outcome_r)
        shutil.rmtree(relay_dir, ignore_errors=True)


def _root_only(arenas) -> pb.EngineRank:
    """A Register message naming a fresh shm object of root's, mode 0600."""
    message = engine_pb(GROUPS[0], "by-name", arenas)
    info = os.stat(SHM_DIR / arenas[-1].name)
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o600)
    return message


@pytest.fixture
def socket_dir(workdir):
    path = tempfile.mkdtemp(prefix="kvg", dir=workdir)
    for directory in (workdir, path):
        os.chmod(directory, 0o755)  # others may reach the socket; its own mode decides
    yield path
    os.chmod(workdir, 0o700)


def test_a_group_member_cannot_have_a_root_only_object_opened_by_name(socket_dir):
    daemon = DaemonProcess("shm-group", socket_dir=socket_dir, extra_args=("--engine-socket-group", str(OTHER)))
    arenas = []
    try:
        with _relay_as(OTHER, daemon.socket) as (path, outcome):
            assert outcome == "connected"  # the kernel admits a member of the group
            member = EngineClient(f"unix:{path}", timeout_s=10)
            message = _root_only(arenas)
            code, details = status(lambda: member.register(message, lease_s=30))
            assert code == C.PERMISSION_DENIED and "shm_fd_index" in details, (code, details)
            # The control: an object the group may open itself is opened by name for a member.
            os.chown(SHM_DIR / arenas[-1].name, -1, OTHER)
            os.chmod(SHM_DIR / arenas[-1].name, 0o660)
            member.register(message, lease_s=30)
            member.deregister()
            member.close()
    finally:
        daemon.terminate()
        for arena in arenas:
            arena.close()


def test_the_default_socket_admits_no_other_user_to_try(socket_dir):
    daemon = DaemonProcess("shm-default", socket_dir=socket_dir)
    arenas = []
    try:
        with _relay_as(OTHER, daemon.socket) as (_path, outcome):
            assert outcome == "EACCES"
        # Root (with the daemon's user, the only one admitted) could open the object itself: allowed.
        owner = EngineClient(daemon.engine_target)
        owner.register(_root_only(arenas), lease_s=30)
        owner.deregister()
        owner.close()
    finally:
        daemon.terminate()
        for arena in arenas:
            arena.close()


def test_over_engine_tcp_only_an_object_open_to_everyone_is_opened_by_name(workdir, ca, tmp_path):
    issued = ca.issue("shm-tcp", dns_names=("kvxferd-engine", "kvxferd-peer"), spiffe_id=SPIFFE)
    token = "t0ken-" + "y" * 26
    (tmp_path / "token").write_text(token)
    daemon = DaemonProcess("shm-tcp", socket_dir=workdir, extra_args=(
        "--engine-tcp", "127.0.0.1:0", "--engine-token-file", str(tmp_path / "token"), *tls_args(ca, issued)))
    arenas = []
    try:
        credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes())
        remote = EngineClient(daemon.addresses["engine_tcp"], credentials=credentials, token=token,
                              channel_options=(("grpc.ssl_target_name_override", "kvxferd-engine"),))
        message = _root_only(arenas)
        code, details = status(lambda: remote.register(message, lease_s=30))
        assert code == C.PERMISSION_DENIED and "everyone" in details, (code, details)
        os.chmod(SHM_DIR / arenas[-1].name, 0o666)  # the control: anyone may open it anyway
        remote.register(message, lease_s=30)
        remote.deregister()
        remote.close()
    finally:
        daemon.terminate()
        for arena in arenas:
            arena.close()


def test_a_foreign_reads_socket_fails_reads_at_once_and_keeps_the_registration(socket_dir):
    """The daemon's gRPC socket is its own, but another user listens on its reads socket: the client sends
    nothing there, refuses reads at once (before, the error escaped register, or after a re-registration
    reads queued on a stream nobody read and waited forever), and its registration stays alive."""
    daemon = DaemonProcess("foreign-reads", socket_dir=socket_dir)
    reads_path = daemon.socket + ".reads"
    os.unlink(reads_path)
    squatter = socket.socket(socket.AF_UNIX)
    squatter.bind(reads_path)
    child = os.fork()
    if child == 0:  # listen as another user: SO_PEERCRED reports who called listen()
        try:
            _become(OTHER)
            squatter.listen()
            time.sleep(60)
        finally:
            os._exit(0)
    arenas = []
    try:
        time.sleep(0.3)
        client = EngineClient(daemon.engine_target, timeout_s=5)
        client.register(engine_pb(GROUPS[0], "reads-squatted", arenas), lease_s=2)
        spec = client.read_spec("r", "nobody", "r", [[1]], [[1]])
        with pytest.raises(PermissionDeniedError, match=f"uid {OTHER}"):
            client.reads.submit_reads([spec])
        time.sleep(3)  # longer than the lease: heartbeats keep the registration
        client.stub.Heartbeat(pb.HeartbeatRequest(engine_id=client.engine_id), timeout=5)
        client.deregister()
        client.close()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        squatter.close()
        daemon.terminate()
        for arena in arenas:
            arena.close()
