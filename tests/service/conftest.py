"""Fixtures for tests that run real daemons (UNIX sockets need short paths)."""

import shutil
import tempfile

import pytest


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="kvx")
    yield path
    shutil.rmtree(path, ignore_errors=True)
