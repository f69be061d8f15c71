"""Issue 35, attack 3: the default ``kvxferd serve`` trusted every local user on its loopback peer port.

Any uid on the host got the engine-id oracle, agent metadata and hold keys
(so raw NIXL READ and WRITE of every cache), early CONSUMED and endless
renewals. Now, without TLS, a peer call must follow a challenge this daemon
issued and carry its token: an HMAC of this host's peer secret (a 0600 file
in the daemons' private runtime directory) over the address it dialed and
both nonces, taken once (issue 53); in the chart's configuration (mutual
TLS) the token opens nothing. Tried here as a local user would: no token, a
made-up secret, a token for another address, a replayed one, and a listener
that an engine got a daemon to dial (it gets a challenge, nothing else).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import grpc
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups
from kvxferd.wire.challenge import CHALLENGE_KEY, Nonces, call_token, new_nonce
from kvxferd.wire.peerauth import PEER_TOKEN_KEY, default_peer_secret_file, peer_channel, read_peer_secret
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from tests.security.conftest import SPIFFE, tls_args
from tests.security.test_peer_dial import Attacker

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


def codes(cluster, token_of=None, *, replay: bool = False) -> dict[str, C]:
    """The answers of every probe on a plaintext channel. With ``token_of(nonces)``, each probe follows a
    challenge of the daemon's and carries that token (``replay``: the same challenge twice, the second's
    answer counts)."""
    found = {}
    with grpc.insecure_channel(cluster.prefill_daemons[0].peer_address) as channel:
        stub = peer_grpc.PeerServiceStub(channel)
        for name, (method, request) in probes(cluster).items():
            try:
                metadata = ()
                if token_of is not None:
                    client = new_nonce()
                    reply = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=client),
                                           timeout=5)
                    nonces = Nonces(client, reply.server_nonce)
                    metadata = ((CHALLENGE_KEY, nonces.text()), (PEER_TOKEN_KEY, token_of(nonces)))
                if replay:
                    getattr(stub, method)(request, metadata=metadata, timeout=5)
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
    address = cluster.prefill_daemons[0].peer_address
    assert codes(cluster, lambda n: call_token(os.urandom(32), address, n)) == refused(cluster)  # made-up secret
    secret = read_peer_secret(default_peer_secret_file())
    port = address.rsplit(":", 1)[1]
    # This host's secret, but the token of another port, of an alias of this one that another user could bind
    # (the daemon listens on 127.0.0.1 only), of other nonces, or one replayed.
    for other in ("127.0.0.1:1", f"[::1]:{port}", f"localhost:{port}"):
        assert codes(cluster, lambda n: call_token(secret, other, n)) == refused(cluster), other
    assert codes(cluster, lambda n: call_token(secret, address, Nonces(new_nonce(), n.server))) == refused(cluster)
    replayed = codes(cluster, lambda n: call_token(secret, address, n), replay=True)
    if cluster.param == "chart":
        assert replayed == refused(cluster)
    else:  # the calls that pass the first time (the others fail after authentication, before the replay)
        assert replayed["incarnation"] == replayed["renew"] == C.UNAUTHENTICATED


def test_the_hosts_token_is_served_only_without_tls(cluster):
    """The control: the token of the dialed address gets real answers, and opens nothing where TLS is on."""
    address = cluster.prefill_daemons[0].peer_address
    secret = read_peer_secret(default_peer_secret_file())
    found = codes(cluster, lambda n: call_token(secret, address, n))
    if cluster.param == "chart":
        assert found == refused(cluster)
        return
    # No reader agent metadata: engine info is refused after authentication; renewing an unheld id names it.
    assert found == {"incarnation": C.OK, "incarnation (invented id)": C.NOT_FOUND,
                     "engine info": C.INVALID_ARGUMENT, "renew": C.OK}
    with peer_channel(address) as channel:  # what tools and tests use
        reply = peer_grpc.PeerServiceStub(channel).GetIncarnation(pb.IncarnationRequest(engine_id=cluster.prefill_id))
    assert reply.incarnation == cluster.prefill_clients[0].incarnation


@pytest.mark.parametrize("uid", [None, 65534], ids=["own-uid", "another-uid"])
def test_a_listener_an_engine_named_gets_a_challenge_and_nothing_else(cluster, uid):
    """An engine names the addresses its daemon dials. A listener there (of this user, or another: before
    issue 53 the first got the token of its own address, the second nothing only thanks to a uid check made
    before connecting) cannot prove the host secret or an allowed certificate: it gets a challenge, no token,
    no notice-agent metadata, and the handshake is refused naming the uid where it is another's."""
    if cluster.param == "chart":
        pytest.skip("test_peer_dial.py tries listeners with certificates")
    attacker = Attacker(uid=uid)
    try:
        assert attacker.listening.wait(30)
        with pytest.raises(grpc.RpcError) as err:
            cluster.decode_clients[0].handshake("victim", [f"127.0.0.1:{attacker.port}"])
    finally:
        attacker.stop()
    assert [c["method"] for c in attacker.calls] == ["Challenge"] and attacker.secrets_seen() == []
    assert err.value.code() == C.PERMISSION_DENIED
    assert ("uid 65534" in err.value.details()) == (uid is not None), err.value.details()


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
