"""Issue 35, attack 3: the default ``kvxferd serve`` trusted every local user on its loopback peer port.

Any uid on the host got the engine-id oracle, agent metadata and hold keys
(so raw NIXL READ and WRITE of every cache), early CONSUMED and endless
renewals. Now, without TLS, a peer call must carry the token of this host's
peer secret (a 0600 file in the daemons' private runtime directory) for the
address it dialed; in the chart's configuration (mutual TLS) the token opens
nothing. Tried here as a local user would: no token, a made-up secret, a
token for another address, and a token captured by a listener that an
engine got a daemon to dial.
"""

from __future__ import annotations

import os
import queue
import stat
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.verify.daemons import DaemonCluster
from kvxferd.verify.models import ModelShape, model_groups
from kvxferd.wire.peerauth import (PEER_TOKEN_KEY, default_peer_secret_file, peer_channel, peer_token,
                                   read_peer_secret, token_window)
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from tests.security.conftest import SPIFFE, tls_args

GROUPS = model_groups("gqa", ModelShape())
C = grpc.StatusCode


@pytest.fixture(scope="module", params=["default", "chart"])
def cluster(request, workdir, ca):
    args = ()
    if request.param == "chart":
        args = tls_args(ca, ca.issue("secret", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE))
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name=f"secret-{request.param}", daemon_args=args) as c:
        c.param = request.param
        yield c


def probes(cluster) -> dict[str, tuple[str, object]]:
    engine_id = cluster.prefill_id
    return {
        "incarnation": ("GetIncarnation", pb.IncarnationRequest(engine_id=engine_id)),
        "incarnation (invented id)": ("GetIncarnation", pb.IncarnationRequest(engine_id="invented")),
        "engine info": ("GetEngineInfo", pb.EngineInfoRequest(engine_id=engine_id, protocol_version=PROTOCOL_VERSION,
                                                              tp_rank=0)),
        "renew": ("RenewLeases", pb.RenewLeaseRequest(engine_id=engine_id, request_ids=["r"], lease_s=30)),
    }


def codes(cluster, metadata: tuple = ()) -> dict[str, C]:
    """The answers of every probe on a plaintext channel carrying ``metadata``."""
    found = {}
    with grpc.insecure_channel(cluster.prefill_daemons[0].peer_address) as channel:
        stub = peer_grpc.PeerServiceStub(channel)
        for name, (method, request) in probes(cluster).items():
            try:
                getattr(stub, method)(request, metadata=metadata, timeout=5)
                found[name] = C.OK
            except grpc.RpcError as err:
                found[name] = err.code()
    return found


def refused(cluster) -> dict[str, C]:
    """What a refused caller gets from every probe: the same for a real and an invented engine id (no oracle);
    with TLS the plaintext channel does not even connect."""
    code = C.UNAVAILABLE if cluster.param == "chart" else C.UNAUTHENTICATED
    return dict.fromkeys(probes(cluster), code)


def test_a_local_user_without_the_token_is_refused(cluster):
    assert codes(cluster) == refused(cluster)
    address, window = cluster.prefill_daemons[0].peer_address, token_window()
    made_up = peer_token(os.urandom(32), address, window)
    assert codes(cluster, ((PEER_TOKEN_KEY, made_up),)) == refused(cluster)
    secret = read_peer_secret(default_peer_secret_file())
    port = address.rsplit(":", 1)[1]
    # This host's secret, but the token of another port, of an alias of this one that another user could bind
    # (the daemon listens on 127.0.0.1 only), or of a window long past.
    for other in ("127.0.0.1:1", f"[::1]:{port}", f"localhost:{port}"):
        assert codes(cluster, ((PEER_TOKEN_KEY, peer_token(secret, other, window)),)) == refused(cluster), other
    assert codes(cluster, ((PEER_TOKEN_KEY, peer_token(secret, address, window - 2)),)) == refused(cluster)


def test_the_hosts_token_is_served_only_without_tls(cluster):
    """The control: the token of the dialed address gets real answers, and opens nothing where TLS is on."""
    address = cluster.prefill_daemons[0].peer_address
    token = peer_token(read_peer_secret(default_peer_secret_file()), address, token_window())
    found = codes(cluster, ((PEER_TOKEN_KEY, token),))
    if cluster.param == "chart":
        assert found == refused(cluster)
        return
    # No reader agent metadata: engine info is refused after authentication; renewing an unheld id names it.
    assert found == {"incarnation": C.OK, "incarnation (invented id)": C.NOT_FOUND,
                     "engine info": C.INVALID_ARGUMENT, "renew": C.OK}
    with peer_channel(address) as channel:  # what tools and tests use
        reply = peer_grpc.PeerServiceStub(channel).GetIncarnation(pb.IncarnationRequest(engine_id=cluster.prefill_id))
    assert reply.incarnation == cluster.prefill_clients[0].incarnation


class _Capture(peer_grpc.PeerServiceServicer):
    """A local user's listener: records the metadata of whatever calls it."""

    def __init__(self) -> None:
        self.seen: queue.Queue = queue.Queue()

    def GetEngineInfo(self, request, context):  # noqa: N802 - gRPC's name
        self.seen.put(dict(context.invocation_metadata()))
        context.abort(C.UNAVAILABLE, "captured")


def test_a_token_captured_by_a_listener_an_engine_named_opens_nothing(cluster):
    """An engine names the addresses its daemon dials: a local user's listener among them learns the token of
    its own address only, which the real daemon refuses."""
    capture = _Capture()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    peer_grpc.add_PeerServiceServicer_to_server(capture, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(grpc.RpcError):
            cluster.decode_clients[0].handshake("victim", [f"127.0.0.1:{port}"])
        seen = capture.seen.get(timeout=5) if cluster.param == "default" else None
    finally:
        server.stop(0)
    if cluster.param == "chart":  # TLS: the daemon's handshake with a plaintext listener fails, no call is made
        assert capture.seen.empty()
        return
    token = seen.get(PEER_TOKEN_KEY, "")
    assert token, "the daemon dialed without a token (nothing to capture: the test would prove nothing)"
    assert codes(cluster, ((PEER_TOKEN_KEY, token),)) == refused(cluster)


def test_a_listener_of_another_user_is_sent_no_token(cluster):
    """A local user listens where an engine makes the daemon dial (here: a port of its own; before, also a
    port a daemon would take later, or [::1] of a daemon's port). The daemon looks the listener's uid up
    first and sends no token to another user: the handshake is refused, nothing was captured."""
    if cluster.param == "chart":
        pytest.skip("with TLS the daemon dials only peers whose certificate names peer_server_name")
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys\nos.setgid(65534); os.setuid(65534)\ns = socket.socket()\n"
        "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
        "s.settimeout(5)\ntry:\n    c, _ = s.accept(); c.settimeout(2); print(len(c.recv(65536)), flush=True)\n"
        "except OSError:\n    print(0, flush=True)\n")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with pytest.raises(grpc.RpcError) as err:
            cluster.decode_clients[0].handshake("victim", [f"127.0.0.1:{port}"])
        assert err.value.code() == C.PERMISSION_DENIED and "uid 65534" in err.value.details()
        assert int(child.stdout.readline()) == 0  # not a byte reached it
    finally:
        child.kill()
        child.wait(10)


def test_the_secret_file_is_private_and_checked(workdir):
    path = default_peer_secret_file()
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) & 0o077 == 0 and info.st_uid == os.getuid()
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o077 == 0
    # Another uid cannot read it (a child that drops to nobody).
    read_as_nobody = ("import os, sys\nos.setgid(65534); os.setuid(65534)\n"
                      f"try:\n    open({path!r}).read()\nexcept PermissionError:\n    sys.exit(7)\n")
    assert subprocess.run([sys.executable, "-c", read_as_nobody]).returncode == 7
    # A daemon refuses a secret file others may read (it would admit every local user), and says why.
    loose = os.path.join(workdir, "loose.secret")
    with open(loose, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(loose, 0o644)
    result = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--peer-port", "0", "--notify-port", "0",
                             "--metrics-port", "0", "--engine-socket", f"{workdir}/loose.sock",
                             "--peer-secret-file", loose], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "peer_secret_file" in result.stderr and "644" in result.stderr, result.stderr
    # Control: the same file made private is taken.
    os.chmod(loose, 0o600)
    daemon = DaemonProcess("loose", socket_dir=workdir, extra_args=("--peer-secret-file", loose))
    try:
        assert EngineClient(daemon.engine_target).stub is not None
    finally:
        daemon.terminate()
