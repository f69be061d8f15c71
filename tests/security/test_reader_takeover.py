"""Issue 35: an allowed peer re-introduced itself as an existing reader of another tenant.

The holder took the newcomer's agent as the reader's, so the real reader's
notices were dropped as foreign and its holds stayed pinned until their
leases ran out. Now only the peer identity that introduced a reader may
replace its agent: in the chart's configuration (mutual TLS) another
allowed identity naming the reader gets an entry of its own (issue 53:
before, it was refused, and had it come first it would have held the owner
out: tests/security/test_reader_expiry.py); in the default one, a local
user without the host's peer token is refused before anything. The real
reader's next read still ends its holds CONSUMED.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.security.conftest import SPIFFE, tls_args

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
OTHER = "spiffe://kvxferd.test/ns/other-tenant/sa/kvxferd"  # allowed too, but not the reader's identity


@pytest.fixture(scope="module", params=["default", "chart"])
def cluster(request, workdir, ca):
    args = ()
    if request.param == "chart":
        args = tls_args(ca, ca.issue("takeover", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE),
                        allowed=f"{SPIFFE},{OTHER}")
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name=f"takeover-{request.param}", daemon_args=args) as c:
        c.param = request.param
        yield c


def _channel(cluster, ca, spiffe_id: str) -> grpc.Channel:
    address = cluster.prefill_daemons[0].peer_address
    if cluster.param == "default":
        return peer_channel(address) if spiffe_id == SPIFFE else grpc.insecure_channel(address)
    issued = ca.issue(spiffe_id.rsplit("/", 3)[-3], dns_names=("kvxferd-peer",), spiffe_id=spiffe_id)
    credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                               issued.cert.read_bytes())
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "kvxferd-peer")])


def _introduce(channel, cluster, reader_engine_id: str, agent: NixlAgent) -> C:
    try:
        peer_grpc.PeerServiceStub(channel).GetEngineInfo(pb.EngineInfoRequest(
            engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
            reader_engine_id=reader_engine_id, reader_tp_rank=0, reader_tp_size=1,
            reader_agent_metadata=agent.metadata()), timeout=10)
        return C.OK
    except grpc.RpcError as err:
        return err.code()


def test_another_identity_cannot_take_over_a_reader(cluster, ca):
    first = random_request("before", *GROUPS, 32, np.random.default_rng(1))
    cluster.hold(first)
    cluster.submit(first)  # the decode daemon introduces itself as reader (decode engine, rank 0)
    assert all(c.ok for c in cluster.completions(first))
    assert [e.kind for e in cluster.hold_events(first)] == [pb.NotifyEvent.CONSUMED]
    rogue = NixlAgent(f"takeover-rogue-{cluster.param}")
    try:
        with _channel(cluster, ca, OTHER) as channel:
            code = _introduce(channel, cluster, cluster.decode_id, rogue)
        assert code == (C.OK if cluster.param == "chart" else C.UNAUTHENTICATED)  # (chart: its own entry)
        # The real reader's notices still count: its next read ends its hold at once, not at lease end.
        second = random_request("after", *GROUPS, 32, np.random.default_rng(2))
        cluster.hold(second, lease_s=60)
        cluster.submit(second)
        assert all(c.ok for c in cluster.completions(second))
        assert [e.kind for e in cluster.hold_events(second, timeout_s=10)] == [pb.NotifyEvent.CONSUMED]
        # Control: the identity that introduced a reader may introduce it again (a restarted reader), and a
        # new reader id is open to any allowed identity.
        with _channel(cluster, ca, SPIFFE) as channel:
            assert _introduce(channel, cluster, "a-new-reader", rogue) == C.OK
        if cluster.param == "chart":
            with _channel(cluster, ca, OTHER) as channel:
                assert _introduce(channel, cluster, "another-new-reader", rogue) == C.OK
    finally:
        rogue.close()
