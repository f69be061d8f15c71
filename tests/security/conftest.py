"""Fixtures for the security tests: a throw-away CA, and daemons with mutual TLS on."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from kvxferd.rig.verify.certs import DevCA, Issued

SPIFFE = "spiffe://kvxferd.test/ns/serving/sa/kvxferd"


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="kvs")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ca(workdir) -> DevCA:
    return DevCA(f"{workdir}/pki")


def tls_args(ca: DevCA, issued: Issued, allowed: str = SPIFFE) -> tuple[str, ...]:
    """``kvxferd serve`` flags for mutual TLS with ``issued`` as this daemon's certificate."""
    return ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key), "--tls-ca", str(ca.cert_path),
            "--peer-allowed-ids", allowed)
