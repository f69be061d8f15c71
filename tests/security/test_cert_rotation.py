"""Issue 11: certificates rotate in place (as cert-manager does) without a restart.

Both daemons read the same three files. Replacing them with a certificate
off the allow-list makes the next handshake fail (the reader presents the
new certificate on a new connection, the holder refuses it); replacing them
with a certificate of a *new* CA makes handshakes and reads work again
(both sides trust the new CA and serve the new certificate). The daemons'
pids never change.
"""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest

from kvxferd.verify.certs import DevCA
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.verify.daemons import DaemonCluster
from kvxferd.verify.models import ModelShape, model_groups, random_request
from tests.security.conftest import SPIFFE

GROUPS = model_groups("gqa", ModelShape())


def install(ca: DevCA, name: str, spiffe_id: str, directory) -> None:
    """Replace the daemons' files atomically, key first (a rotating Secret mount)."""
    issued = ca.issue(name, dns_names=("kvxferd-peer",), spiffe_id=spiffe_id)
    for source, target in ((issued.key, "tls.key"), (issued.cert, "tls.crt"), (ca.cert_path, "ca.crt")):
        shutil.copyfile(source, directory / f".{target}")
        (directory / f".{target}").replace(directory / target)


def test_rotation_takes_effect_on_new_connections_without_restart(tmp_path):
    tls = tmp_path / "tls"
    tls.mkdir()
    first_ca, second_ca = DevCA(tmp_path / "ca1", name="CA one"), DevCA(tmp_path / "ca2", name="CA two")
    install(first_ca, "daemon", SPIFFE, tls)
    args = ("--tls-cert", str(tls / "tls.crt"), "--tls-key", str(tls / "tls.key"), "--tls-ca", str(tls / "ca.crt"),
            "--peer-allowed-ids", SPIFFE)
    with DaemonCluster(*GROUPS, 1, 1, workdir=str(tmp_path), name="rot", daemon_args=args) as cluster:
        pids = [d.process.pid for d in cluster.daemons]
        decode = cluster.decode_clients[0]

        install(first_ca, "rogue", "spiffe://kvxferd.test/ns/serving/sa/rogue", tls)
        with pytest.raises(grpc.RpcError) as refused:
            decode.handshake(cluster.prefill_id, [cluster.prefill_daemons[0].peer_address])
        assert "PERMISSION_DENIED" in refused.value.details() and "rogue" in refused.value.details()

        install(second_ca, "daemon-2", SPIFFE, tls)
        cluster.handshake()
        request = random_request("rotated", *GROUPS, 40, np.random.default_rng(1))
        completions = cluster.read(request, timeout_s=20)
        assert all(c.ok for c in completions), [c.error for c in completions]
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]
        assert [d.process.pid for d in cluster.daemons] == pids and all(d.process.poll() is None for d in cluster.daemons)
        assert all(d.metric("kvxferd_tls_reloads_total") >= 2 for d in cluster.daemons)
