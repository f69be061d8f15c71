"""Metadata that does not outlive trust (issue #55 item 3), against real daemons with mutual TLS and workers:
when an identity's last introduction ends, when a certificate the metadata went to nears its expiry, and when
the CA bundle withdraws a CA, the rank's worker is replaced (make before break; on a withdrawal its reader
worker too, whose address the holders it connected to learned) and what a peer was handed
before reaches nothing, while fresh metadata reads byte-exact and holds placed before end CONSUMED. The
controls: a reader that introduces another agent of its own, a long-lived certificate and a CA added to the
bundle replace nothing; a certificate about to expire is handed no metadata."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.attack.reach import reaches
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.certs import DevCA
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent
from tests.security.conftest import SPIFFE, tls_args

pytestmark = pytest.mark.daemons
GROUPS = model_groups("gqa", ModelShape())
OTHER = "spiffe://kvxferd.test/ns/serving/sa/other-reader"  # allowed identities of their own
THIRD = "spiffe://kvxferd.test/ns/serving/sa/third-reader"
GRACE_S = 3.0
IDLE_S = 3.0  # two readers per rank (the decode rank's, kept active by its probes, and one more)
LEAD_S = GRACE_S + 0.0 + 60.0  # replaced this long before a certificate expires (registry.TRUST_LEAD_S)
BOUND_S = 40.0  # a replacement's successor up, and the old one retired (about 2 s + the grace here)
REPLACEMENTS = "kvxferd_dataplane_worker_replacements_total"


@pytest.fixture(scope="module")
def cluster(workdir, ca):
    issued = ca.issue("kvxferd", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE)
    args = (*tls_args(ca, issued, allowed=f"{SPIFFE},{OTHER},{THIRD}"), "--dataplane-workers",
            "--dataplane-reader-workers", "--worker-retire-grace-s", str(GRACE_S), "--worker-replace-interval-s", "0",
            "--max-readers-per-engine", "2", "--reader-idle-s", str(IDLE_S), "--peer-check-s", "0.5")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", "tcp")
        with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="tr", daemon_args=args) as c:
            c.other = ca.issue("other", dns_names=("other-reader",), spiffe_id=OTHER)
            c.third = ca.issue("third", dns_names=("third-reader",), spiffe_id=THIRD)
            yield c


def peer_channel(cluster, ca, issued) -> grpc.Channel:
    """A channel to the prefill daemon's peer port as the peer holding ``issued``."""
    credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes(), issued.key.read_bytes(),
                                               issued.cert.read_bytes())
    return grpc.secure_channel(cluster.prefill_daemons[0].peer_address, credentials,
                               options=[("grpc.ssl_target_name_override", "kvxferd-peer")])


def engine_info(cluster, ca, issued, reader_engine_id: str, channel: grpc.Channel | None = None) -> pb.EngineInfo:
    """The prefill rank's engine info as the peer holding ``issued`` gets it (on ``channel``, else a new
    one), introducing a new agent."""
    reader = NixlAgent(f"tr-intro-{time.monotonic_ns()}")
    own = channel is None
    channel = peer_channel(cluster, ca, issued) if own else channel
    try:
        reply = peer_grpc.PeerServiceStub(channel).GetEngineInfo(pb.EngineInfoRequest(
            engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0,
            reader_engine_id=reader_engine_id, reader_tp_rank=0, reader_tp_size=1,
            reader_agent_metadata=reader.metadata()), timeout=10)
    finally:
        reader.close()
        if own:
            channel.close()
    info = pb.EngineInfo()
    info.ParseFromString(reply.payload)
    return info


def answers(info: pb.EngineInfo) -> bool:
    """Whether the hold board's first bucket is read through ``info``'s metadata."""
    return reaches(info.agent_metadata, info.hold_board.address)


def replaced(daemon, reason: str) -> float:
    return daemon.metric(REPLACEMENTS, f'reason="{reason}"')


def wait_retired(daemon, num_retired: int) -> None:
    """Until ``num_retired`` replaced generations were stopped (their successor up, the grace over)."""
    deadline = time.monotonic() + BOUND_S
    while daemon.log_text().count(") retired") < num_retired:
        assert time.monotonic() < deadline, f"not {num_retired} retired: {daemon.tail()}"
        time.sleep(0.1)


def read_held(cluster, request) -> None:
    """Read ``request`` (held before) until ok; then it must be byte-exact and its hold CONSUMED."""
    deadline = time.monotonic() + BOUND_S
    while not all(c.ok for c in cluster.read(request, timeout_s=20, hold=False)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def test_an_identitys_ended_introduction_replaces_the_worker_and_its_old_metadata_reaches_nothing(cluster, ca):
    prefill = cluster.prefill_daemons[0]
    request = random_request("tr-intro", *GROUPS, 64, np.random.default_rng(1))
    cluster.reset_decode()
    cluster.hold(request)
    first = engine_info(cluster, ca, cluster.other, "tr-reader-a")
    assert answers(first)  # the control: what was handed reaches the worker
    engine_info(cluster, ca, cluster.other, "tr-reader-a")  # the same reader, another agent: no trust ended
    time.sleep(IDLE_S + 0.5)  # reader-a idles past reader_idle_s
    assert replaced(prefill, "introduction_ended") == 0 and prefill.log_text().count(") retired") == 0
    engine_info(cluster, ca, cluster.third, "tr-reader-c")  # the rank is full: OTHER's only reader is evicted
    wait_retired(prefill, 1)
    assert replaced(prefill, "introduction_ended") == 1
    assert not answers(first)  # what OTHER was handed names an agent that is gone
    assert answers(engine_info(cluster, ca, cluster.third, "tr-reader-c"))
    read_held(cluster, request)  # the hold outlived its worker
    assert prefill.metric("kvxferd_dataplane_worker_deaths_total") == 0  # replaced, not dead


def test_metadata_handed_to_a_certificate_near_its_expiry_is_replaced_before_it(cluster, ca):
    prefill = cluster.prefill_daemons[0]
    retired = prefill.log_text().count(") retired")
    long_lived = engine_info(cluster, ca, cluster.third, "tr-reader-c")
    time.sleep(2.0)  # the control: a certificate valid for 30 days leaves the worker alone (checked every 1 s)
    assert replaced(prefill, "certificate_expires") == 0 and prefill.log_text().count(") retired") == retired
    too_short = ca.issue("too-short", dns_names=("third-reader",), spiffe_id=THIRD, valid_s=LEAD_S - 10)
    with pytest.raises(grpc.RpcError) as refused:  # it would be due at once, and again after each replacement
        engine_info(cluster, ca, too_short, "tr-reader-c")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "renew it" in refused.value.details()
    # Due 20 s from now: time enough to hand it metadata first, on a loaded machine too.
    short = ca.issue("short", dns_names=("third-reader",), spiffe_id=THIRD, valid_s=LEAD_S + 20)
    handed = engine_info(cluster, ca, short, "tr-reader-c")
    wait_retired(prefill, retired + 1)
    assert replaced(prefill, "certificate_expires") == 1
    assert not answers(handed) and not answers(long_lived)  # one worker: everyone's metadata goes with it
    assert answers(engine_info(cluster, ca, cluster.third, "tr-reader-c"))


def test_a_ca_withdrawn_from_the_bundle_replaces_every_worker(cluster, ca, workdir):
    prefill, decode = cluster.prefill_daemons[0], cluster.decode_daemons[0]
    retired = {d: d.log_text().count(") retired") for d in (prefill, decode)}
    request = random_request("tr-ca", *GROUPS, 64, np.random.default_rng(2))
    cluster.reset_decode()
    cluster.hold(request)
    before = engine_info(cluster, ca, cluster.third, "tr-reader-c")
    bundle, next_ca = ca.cert_path.read_bytes(), DevCA(f"{workdir}/pki-next", name="kvxferd next CA")
    # A rotation's first step adds the next CA: it ends no trust (the control: nothing is replaced) ...
    reloads = prefill.log_text().count("TLS files reloaded")
    ca.cert_path.write_bytes(bundle + next_ca.cert_path.read_bytes())
    deadline = time.monotonic() + BOUND_S
    while prefill.log_text().count("TLS files reloaded") == reloads:  # looked at every 1 s
        assert time.monotonic() < deadline, "the bundle was not reloaded"
        time.sleep(0.1)
    time.sleep(1.0)  # a replacement asked for at the reload would start within milliseconds (interval 0)
    assert replaced(prefill, "ca_changed") == 0
    # A peer whose certificate only the next CA vouches for connects, and stays connected.
    vouched = next_ca.issue("third-next", dns_names=("third-reader",), spiffe_id=THIRD)
    connected = peer_channel(cluster, ca, vouched)
    try:
        assert answers(engine_info(cluster, ca, vouched, "tr-reader-c", connected))  # the control: it is trusted
        ca.cert_path.write_bytes(bundle)  # ... withdrawing it ends trust: its peers may hold metadata
        for daemon in (prefill, decode):  # each rank's two workers: its holder's and its reader's (the
            wait_retired(daemon, retired[daemon] + 2)  # holders it connected to learned that one's address)
            assert replaced(daemon, "ca_changed") == 2
        # Its connection was closed with the withdrawal: on the same channel it gets no new metadata
        # (the TLS handshake of its new connection refuses its certificate).
        with pytest.raises(grpc.RpcError):
            engine_info(cluster, ca, vouched, "tr-reader-c", connected)
    finally:
        connected.close()
    assert not answers(before)
    read_held(cluster, request)  # the reader's worker was replaced too: its new notice agent was introduced
