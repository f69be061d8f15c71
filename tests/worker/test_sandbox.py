"""The worker's Landlock boundary: after ``restrict()`` a process of the daemon's user can no longer open
the daemon's files or ``/proc`` entries, nor signal it; before it, the same calls succeed (the control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvxferd.worker import sandbox

PROBE = """
import json, os, sys
from kvxferd.worker import sandbox
secret_file, parent = sys.argv[1], int(sys.argv[2])

def attempts():
    out = {}
    for name, call in (("secret file", lambda: open(secret_file).read()),
                       ("parent environ", lambda: open(f"/proc/{parent}/environ", "rb").read()),
                       ("parent fds", lambda: os.listdir(f"/proc/{parent}/fd")),
                       ("signal parent", lambda: os.kill(parent, 0)),
                       ("own status", lambda: open(f"/proc/{os.getpid()}/status").read()),
                       ("stdlib", lambda: __import__("decimal"))):
        try:
            call()
            out[name] = "ok"
        except OSError as err:
            out[name] = type(err).__name__
    return out

before = attempts()
confined = sandbox.restrict()
print(json.dumps({"before": before, "sandbox": confined, "after": attempts()}))
"""


@pytest.fixture
def probe(tmp_path):
    secret = tmp_path / "tls.key"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    out = subprocess.run([sys.executable, "-c", PROBE, str(secret), str(os.getpid())], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_a_restricted_worker_cannot_reach_the_daemons_files_proc_or_signals(probe):
    if not probe["sandbox"].startswith("landlock"):
        pytest.skip(f"no Landlock here: {probe['sandbox']}")
    assert set(probe["before"].values()) == {"ok"}  # the control: all of it works unconfined
    after = probe["after"]
    assert after["secret file"] == after["parent environ"] == after["parent fds"] == "PermissionError"
    assert after["own status"] == "ok" and after["stdlib"] == "ok"  # what the worker needs still works
    if int(probe["sandbox"].split()[-1]) >= 6:
        assert after["signal parent"] == "PermissionError"


def test_the_allowed_paths_hold_no_configuration_directory():
    paths = [p for p, _ in sandbox.allowed_paths()]
    assert "/etc" not in paths and "/" not in paths and "/tmp" not in paths and "/home" not in paths
