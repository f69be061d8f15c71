"""A throw-away CA and a work directory for the worker tests' daemons (as tests/security's)."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from kvxferd.rig.verify.certs import DevCA


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="kvw")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ca(workdir) -> DevCA:
    return DevCA(f"{workdir}/pki")
