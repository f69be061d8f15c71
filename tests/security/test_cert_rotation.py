"""Issue 11: certificates rotate in place (as cert-manager does) without a restart.

Both daemons read the same three files. Replacing them with a certificate of
a *new* CA makes handshakes and reads work with it (both sides trust the new
CA and serve the new certificate). Issue 35: a rotation to a certificate the
daemon must not use (off the allow-list, expired, not yet valid, without the
peer server name) is refused, counted and logged, and the previous one stays
in use; a daemon whose first certificate is such one does not start. The
daemons' pids never change.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import numpy as np

from kvxferd.rig.verify.certs import DevCA
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from tests.security.conftest import SPIFFE

GROUPS = model_groups("gqa", ModelShape())


def install(ca: DevCA, name: str, spiffe_id: str, directory, **issue) -> None:
    """Replace the daemons' files atomically, key first (a rotating Secret mount)."""
    issued = ca.issue(name, **{"dns_names": ("kvxferd-peer",), "spiffe_id": spiffe_id, **issue})
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
        assert all(d.metric("kvxferd_tls_files_unusable") == 0 for d in cluster.daemons)

        unusable = [dict(name="rogue", spiffe_id="spiffe://kvxferd.test/ns/serving/sa/rogue"),
                    dict(name="expired", spiffe_id=SPIFFE, valid_s=-60, not_before_s=-3600),
                    dict(name="early", spiffe_id=SPIFFE, not_before_s=3600),
                    dict(name="no-server-name", spiffe_id=SPIFFE, dns_names=("other",))]
        for n, issue in enumerate(unusable, start=1):
            install(first_ca, directory=tls, **issue)
            deadline = time.monotonic() + 10  # each daemon looks at its files every second
            while any(d.metric("kvxferd_tls_refused_total") < n for d in cluster.daemons):
                assert time.monotonic() < deadline, issue["name"]
                time.sleep(0.2)
            decode.handshake(cluster.prefill_id, [cluster.prefill_daemons[0].peer_address])  # the old one serves
            assert all(d.metric("kvxferd_tls_refused_total") == n for d in cluster.daemons), issue["name"]
            assert all(d.metric("kvxferd_tls_reloads_total") == 0 for d in cluster.daemons), issue["name"]
            assert all(d.metric("kvxferd_tls_files_unusable") == 1 for d in cluster.daemons), issue["name"]

        install(second_ca, "daemon-2", SPIFFE, tls)
        cluster.handshake()
        request = random_request("rotated", *GROUPS, 40, np.random.default_rng(1))
        completions = cluster.read(request, timeout_s=20)
        assert all(c.ok for c in completions), [c.error for c in completions]
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]
        assert [d.process.pid for d in cluster.daemons] == pids and all(d.process.poll() is None for d in cluster.daemons)
        assert all(d.metric("kvxferd_tls_reloads_total") == 1 for d in cluster.daemons)
        assert all(d.metric("kvxferd_tls_files_unusable") == 0 for d in cluster.daemons)  # loaded: the alert clears


def test_a_daemon_does_not_start_on_an_expired_certificate(tmp_path):
    ca = DevCA(tmp_path / "ca")
    issued = ca.issue("daemon", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE, valid_s=-60, not_before_s=-3600)
    args = ["--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(ca.cert_path),
            "--peer-allowed-ids", SPIFFE, "--peer-host", "127.0.0.1", "--peer-port", "0"]
    done = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--engine-socket", str(tmp_path / "e.sock"), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "start-up failed" in done.stdout and "expired at" in done.stdout, \
        (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
