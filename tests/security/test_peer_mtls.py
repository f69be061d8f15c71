"""Issue 11, attacks 1-3: the peer port with mutual TLS, against real daemons and real NIXL.

Only a certificate from the configured CA, unexpired, whose identity is on
``peer_allowed_ids``, gets anything from the peer port: no engine-id oracle,
no agent metadata, so no NIXL read or write of a tenant's cache.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from kvxferd.rig.bench.raw import RawReader
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from tests.security.conftest import SPIFFE, tls_args

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
ANSWER_S = 5.0


@pytest.fixture(scope="module")
def cluster(workdir, ca):
    issued = ca.issue("kvxferd", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="tls", daemon_args=tls_args(ca, issued)) as c:
        yield c


def peer_code(address: str, credentials: grpc.ChannelCredentials | None, method: str, request) -> grpc.StatusCode:
    """The status one peer call gets (OK on success)."""
    options = [("grpc.ssl_target_name_override", "kvxferd-peer")]
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(address))
    try:
        getattr(peer_grpc.PeerServiceStub(channel), method)(request, timeout=ANSWER_S)
        return C.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


def credentials_of(ca: DevCA, issued) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(), issued.cert.read_bytes())


def probes(cluster):
    """Attacks 1 and 2: the engine-id oracle and the agent metadata of an invented reader."""
    return {
        "incarnation (real id)": ("GetIncarnation", pb.IncarnationRequest(engine_id=cluster.prefill_id)),
        "incarnation (invented id)": ("GetIncarnation", pb.IncarnationRequest(engine_id="no-such-engine")),
        "engine info": ("GetEngineInfo", pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION,
                                                               tp_rank=0, reader_engine_id="invented", reader_tp_size=1)),
        "renew inf": ("RenewLeases", pb.RenewLeaseRequest(engine_id=cluster.prefill_id, request_ids=["x"], lease_s=1e300)),
    }


def test_transfers_stay_byte_exact_with_mutual_tls(cluster):
    request = random_request("tls-ok", *GROUPS, 64, np.random.default_rng(0))
    completions = cluster.read(request, timeout_s=20)
    assert all(c.ok for c in completions), [c.error for c in completions]
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def test_without_a_client_certificate_nothing_answers(cluster, ca):
    address = cluster.prefill_daemons[0].peer_address
    server_only = grpc.ssl_channel_credentials(ca.cert_path.read_bytes())
    for name, (method, request) in probes(cluster).items():
        assert peer_code(address, None, method, request) == C.UNAVAILABLE, name  # plaintext: no TLS handshake
        assert peer_code(address, server_only, method, request) == C.UNAVAILABLE, name  # TLS, no client cert


def test_untrusted_and_expired_certificates_are_refused(cluster, ca, workdir):
    address = cluster.prefill_daemons[0].peer_address
    other_ca = DevCA(f"{workdir}/other-pki", name="someone else's CA")
    forged = other_ca.issue("forged", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)  # right identity, wrong CA
    expired = ca.issue("expired", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE, valid_s=-60, not_before_s=-3600)
    method, request = probes(cluster)["incarnation (real id)"]
    for issued, trust in ((forged, ca), (expired, ca)):
        assert peer_code(address, credentials_of(trust, issued), method, request) == C.UNAVAILABLE, issued.cert.name


def test_a_valid_certificate_off_the_allow_list_is_denied_everything(cluster, ca):
    address = cluster.prefill_daemons[0].peer_address
    stranger = credentials_of(ca, ca.issue("stranger", dns_names=("kvxferd-peer",),
                                           spiffe_id="spiffe://kvxferd.test/ns/other-tenant/sa/app"))
    for name, (method, request) in probes(cluster).items():
        # The same answer for a real and an invented engine id: no oracle.
        assert peer_code(address, stranger, method, request) == C.PERMISSION_DENIED, name


def test_an_allowed_identity_is_served(cluster, ca):
    """The control: the same probes with an allowed certificate get real answers."""
    address = cluster.prefill_daemons[0].peer_address
    allowed = credentials_of(ca, ca.issue("allowed", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE))
    codes = {name: peer_code(address, allowed, method, request) for name, (method, request) in probes(cluster).items()}
    assert codes == {"incarnation (real id)": C.OK, "incarnation (invented id)": C.NOT_FOUND,
                     # no reader agent metadata: no metadata or addresses in return
                     "engine info": C.INVALID_ARGUMENT, "renew inf": C.INVALID_ARGUMENT}
    # Each decision is an audit line naming the certificate's identities (issue 35), refusals of strangers too.
    lines = [json.loads(line) for line in cluster.prefill_daemons[0].tail(500_000).splitlines()
             if line.startswith("{") and '"kvxferd.audit"' in line]
    lines = [r for r in lines if r.get("event") == "peer"]  # not the TLS handshakes refused (issue 53)
    assert any(r["method"] == "GetEngineInfo" and r["outcome"] == "INVALID_ARGUMENT" and SPIFFE in r["identity"]
               for r in lines), lines[-5:]
    assert any(r["outcome"] == "PERMISSION_DENIED" and SPIFFE not in r["identity"] and r["identity"] for r in lines)


def test_a_plain_nixl_agent_reads_a_tenants_cache_only_with_an_allowed_certificate(cluster, ca):
    """Attack 3: with the agent metadata a bare NIXL agent reads the cache; the metadata needs an allowed identity."""
    request = random_request("raw-steal", *GROUPS, 32, np.random.default_rng(7))
    addresses = [d.peer_address for d in cluster.prefill_daemons]
    stranger = credentials_of(ca, ca.issue("thief", dns_names=("kvxferd-peer",),
                                           spiffe_id="spiffe://kvxferd.test/ns/other-tenant/sa/app"))
    with pytest.raises(grpc.RpcError) as refused:
        RawReader(cluster.decode[0].cache, cluster.prefill_id, addresses, "thief-agent", stranger)
    assert refused.value.code() == C.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as refused:
        RawReader(cluster.decode[0].cache, cluster.prefill_id, addresses, "thief-agent-2")  # no certificate at all
    assert refused.value.code() == C.UNAVAILABLE
    # The control: the same bare agent with an allowed certificate does read the bytes, so the test can tell.
    cluster.reset_decode()
    allowed = credentials_of(ca, ca.issue("allowed-raw", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE))
    reader = RawReader(cluster.decode[0].cache, cluster.prefill_id, addresses, "allowed-agent", allowed)
    prepared = reader.prepare(request)
    try:
        reader.read(prepared)
    finally:
        reader.release(prepared)
        reader.close()
    assert cluster.verify(request) == ([], 0)


@pytest.mark.parametrize("secret_files", ["one", "each", "unusable"])
def test_with_tls_same_host_reads_need_the_hosts_secret_file_too(workdir, ca, tmp_path, secret_files):
    """Issue #37: with mutual TLS a reader still proves it shares the holder's host with the host secret
    (``peer_secret_file``), which then authenticates nothing else. Daemons that share the file (one pod, a
    hostPath) copy from each other's engines; daemons with a file each (pods of their own) cannot prove it
    and read over NIXL, as exact (the control); a file that cannot be used (mode 0644) turns same-host
    reads off with a warning, not the daemon."""
    issued = ca.issue("kvxferd", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    if secret_files == "unusable":
        (tmp_path / "host.secret").write_text("00" * 32 + "\n")
        (tmp_path / "host.secret").chmod(0o644)

    def secret_of(daemon_id: str) -> tuple[str, ...]:
        return ("--peer-secret-file", str(tmp_path / ("host.secret" if secret_files != "each" else f"{daemon_id}.secret")))

    with DaemonCluster(*GROUPS, 2, 1, workdir=workdir, name=f"tls-sh-{secret_files}",
                       daemon_args=tls_args(ca, issued), args_of=secret_of) as cluster:
        request = random_request("tls-same-host", *GROUPS, 64, np.random.default_rng(3))
        cluster.reset_decode()
        completions = cluster.read(request, timeout_s=20)
        assert all(c.ok for c in completions), [c.error for c in completions]
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        copies = cluster.decode_daemons[0].metric("kvxferd_same_host_copies_total")
        assert copies == (2 if secret_files == "one" else 0)
        warned = ["cannot be used" in daemon.tail(20000) for daemon in cluster.daemons]
        assert warned == [secret_files == "unusable"] * 3


def test_a_caller_without_a_certificate_can_tell_the_refusal_from_a_daemon_that_is_down(cluster, ca):
    """Issue 61: the refusal happens in the TLS handshake, so gRPC's client says UNAVAILABLE. What the docs
    promise (protocol.md, status table): its details end "Socket closed", where a port nobody serves gives
    "Connection refused"; and the daemon logs the refusal as an audit line."""
    import socket

    ca_pem = ca.cert_path.read_bytes()
    options = [("grpc.ssl_target_name_override", "kvxferd-peer")]
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{unused.getsockname()[1]}"
    seen = {}
    for name, address in (("no certificate", cluster.prefill_daemons[0].peer_address), ("down", down)):
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_pem), options=options) as channel:
            with pytest.raises(grpc.RpcError) as err:
                peer_grpc.PeerServiceStub(channel).GetIncarnation(pb.IncarnationRequest(engine_id="x"), timeout=5)
        seen[name] = (err.value.code(), err.value.details())
    assert seen["no certificate"][0] == seen["down"][0] == C.UNAVAILABLE
    assert seen["no certificate"][1].endswith("Socket closed"), seen
    assert "Connection refused" in seen["down"][1], seen
