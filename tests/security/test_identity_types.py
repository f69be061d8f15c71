"""Issue 53, M1: a certificate's names are typed; a DNS SAN that spells the release's SPIFFE id is not it.

The peer port took the identities from gRPC's ``x509_subject_alternative_name``,
which lumps SANs of every type into plain strings: a certificate of the same
CA whose *DNS* SAN was the release's SPIFFE id passed as the release, and
could introduce itself as the release's readers. Now the server reads the
certificate itself, an untyped ``spiffe://`` pattern admits URI SANs only,
and a pattern whose type is unsaid (``kvxferd-peer``) stops the daemon at
start. Chart configuration: mutual TLS, one SPIFFE id allowed.
"""

from __future__ import annotations

import subprocess

import grpc
import numpy as np
import pytest

from kvxferd.client import DaemonProcess
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.security.conftest import SPIFFE, tls_args

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster(workdir, ca):
    issued = ca.issue("typed", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="typed", daemon_args=tls_args(ca, issued)) as c:
        yield c


def _stub(cluster, ca, issued) -> tuple[grpc.Channel, peer_grpc.PeerServiceStub]:
    credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                               issued.cert.read_bytes())
    channel = grpc.secure_channel(cluster.prefill_daemons[0].peer_address, credentials,
                                  options=[("grpc.ssl_target_name_override", "kvxferd-peer")])
    return channel, peer_grpc.PeerServiceStub(channel)


def _code(call) -> C:
    try:
        call()
        return C.OK
    except grpc.RpcError as err:
        return err.code()


def _introduce(stub, cluster, agent: NixlAgent):
    """Introduce ``agent`` as the decode engine's rank 0: the release's real reader."""
    return lambda: stub.GetEngineInfo(pb.EngineInfoRequest(
        engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
        reader_engine_id=cluster.decode_id, reader_tp_rank=0, reader_tp_size=1,
        reader_agent_metadata=agent.metadata()), timeout=10)


def test_a_dns_san_spelling_the_spiffe_id_is_refused_and_the_uri_san_admitted(cluster, ca):
    impostor = ca.issue("dns-spiffe", dns_names=("kvxferd-peer", SPIFFE))  # same CA, no URI SAN
    real = ca.issue("uri-spiffe", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    calls = {
        "GetIncarnation": lambda stub: stub.GetIncarnation(pb.IncarnationRequest(engine_id=cluster.prefill_id),
                                                           timeout=10),
        "RenewLeases": lambda stub: stub.RenewLeases(pb.RenewLeaseRequest(
            engine_id=cluster.prefill_id, request_ids=["x"], lease_s=1), timeout=10),
    }
    channel, stub = _stub(cluster, ca, impostor)
    with channel:
        assert {name: _code(lambda: call(stub)) for name, call in calls.items()} == dict.fromkeys(calls,
                                                                                                  C.PERMISSION_DENIED)
    channel, stub = _stub(cluster, ca, real)  # the control: the URI SAN is the identity
    with channel:
        assert {name: _code(lambda: call(stub)) for name, call in calls.items()} == dict.fromkeys(calls, C.OK)


def test_a_dns_san_spelling_the_spiffe_id_cannot_reintroduce_the_releases_readers(cluster, ca):
    first = random_request("typed-before", *GROUPS, 32, np.random.default_rng(1))
    cluster.hold(first)
    cluster.submit(first)  # the decode daemon introduces the reader (the decode engine, rank 0)
    assert all(c.ok for c in cluster.completions(first))
    assert [e.kind for e in cluster.hold_events(first)] == [pb.NotifyEvent.CONSUMED]
    rogue = NixlAgent("typed-rogue")
    try:
        channel, stub = _stub(cluster, ca, ca.issue("dns-spiffe-2", dns_names=("kvxferd-peer", SPIFFE)))
        with channel:
            assert _code(_introduce(stub, cluster, rogue)) == C.PERMISSION_DENIED  # no agent metadata either
        # The real reader's notices still count: its next read ends its hold at once, not at lease end.
        second = random_request("typed-after", *GROUPS, 32, np.random.default_rng(2))
        cluster.hold(second, lease_s=60)
        cluster.submit(second)
        assert all(c.ok for c in cluster.completions(second))
        assert [e.kind for e in cluster.hold_events(second, timeout_s=10)] == [pb.NotifyEvent.CONSUMED]
        # The control: a certificate with the URI SAN may introduce a reader.
        channel, stub = _stub(cluster, ca, ca.issue("uri-spiffe-2", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE))
        with channel:
            assert _code(lambda: stub.GetEngineInfo(pb.EngineInfoRequest(
                engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
                reader_engine_id="typed-new-reader", reader_tp_rank=0, reader_tp_size=1,
                reader_agent_metadata=rogue.metadata()), timeout=10)) == C.OK
    finally:
        rogue.close()


@pytest.mark.parametrize("pattern", ["kvxferd-peer", "dns://kvxferd-peer"])
def test_a_pattern_without_a_clear_type_stops_the_daemon_at_start(workdir, ca, pattern):
    issued = ca.issue("typed-start", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    daemon = DaemonProcess(f"typed-start-{len(pattern)}", socket_dir=workdir, wait=False,
                           extra_args=tls_args(ca, issued, allowed=f"{SPIFFE},{pattern}"))
    try:
        code = daemon.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        code = None  # it started: the pattern was taken
    finally:
        daemon.terminate()
    assert code == 2, daemon.tail()
    assert "peer_allowed_ids" in daemon.tail() and "write uri:" in daemon.tail()
