"""When a worker's metadata stops being trusted (kvxferd.service.workers.trust), without daemons."""

from __future__ import annotations

import math
import time

from kvxferd.rig.verify.certs import DevCA
from kvxferd.service.workers.trust import CaWatch, HandedMetadata, certificate_expiry_s


def test_a_generation_is_trusted_until_the_first_expiry_of_whom_it_was_handed_to():
    handed = HandedMetadata()
    assert not handed.due(1, now_s=1e12, lead_s=0.0)  # handed to no one: never due
    handed.handed(1, math.inf)  # without TLS: a host's peer secret does not expire
    assert not handed.due(1, now_s=1e12, lead_s=0.0)
    handed.handed(1, 1000.0)
    handed.handed(1, 2000.0)
    assert handed.trusted_until_s == 1000.0
    assert not handed.due(1, now_s=899.0, lead_s=100.0) and handed.due(1, now_s=900.0, lead_s=100.0)
    assert not handed.due(2, now_s=900.0, lead_s=100.0)  # another generation than the one recorded


def test_a_new_generation_starts_afresh_and_an_older_one_changes_nothing():
    handed = HandedMetadata()
    handed.handed(1, 1000.0)
    handed.handed(2, 5000.0)  # the successor: what generation 1 was handed went with it
    assert handed.trusted_until_s == 5000.0 and not handed.due(2, now_s=1000.0, lead_s=0.0)
    handed.handed(1, 10.0)  # handed while the old one still served, during the switch: it is retiring anyway
    assert handed.trusted_until_s == 5000.0


def test_a_certificates_expiry_is_read_from_it(tmp_path):
    ca = DevCA(str(tmp_path / "pki"))
    issued = ca.issue("peer", valid_s=3600)
    expiry_s = certificate_expiry_s(issued.cert.read_bytes())
    assert abs(expiry_s - (time.time() + 3600)) < 120  # notAfter has whole seconds
    assert certificate_expiry_s(b"not a certificate") == math.inf


def test_the_ca_watch_says_withdrawn_only_when_a_ca_left_the_bundle(tmp_path):
    first, second = (DevCA(str(tmp_path / name)).cert_path.read_bytes() for name in ("a", "b"))
    watch = CaWatch(first)
    assert not watch.withdrawn(first) and not watch.withdrawn(b"\n" + first + b"\n")  # the same certificate
    assert not watch.withdrawn(first + second)  # one added: nobody it vouches for was handed anything yet
    assert not watch.withdrawn(second + first)  # reordered
    assert watch.withdrawn(second)  # the first withdrawn
    assert watch.withdrawn(b"not a bundle") and not watch.withdrawn(b"not a bundle")
