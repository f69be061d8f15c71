"""`helm test`'s pod: its script, run here against real daemons, passes only when each one is up and
has its engine rank registered (issue #39).

The rendered script resolves each role's headless Service to pod IPs; here the targets line is
replaced by the real daemons' loopback addresses, the rest runs as the pod would run it.
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.client.launch import free_ports
from kvxferd.rig.verify import chart
from tests.service.helpers import GQA_GROUPS, engine_pb


def _test_pod(values=None) -> dict:
    (pod,) = [o for o in chart.render_objects(values, release="kvx", namespace="serving") if o["kind"] == "Pod"]
    return pod


def _run(script: str, targets: list) -> subprocess.CompletedProcess:
    line = re.search(r"^targets = .*$", script, re.M)
    script = script.replace(line.group(0), f"targets = {json.dumps(targets)}")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_the_test_pod_is_a_hook_that_targets_every_daemon():
    pod = _test_pod()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    targets = json.loads(re.search(r"^targets = (.*)$", container["args"][0], re.M).group(1))
    assert targets == [["kvx-kvxferd-decode-peers", [9464, 9465], 1], ["kvx-kvxferd-prefill-peers", [9464, 9465], 1]]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "Pod" not in {o["kind"] for o in chart.render_objects({"tests": {"enabled": False}})}


@pytest.fixture(scope="module")
def daemon():
    workdir = tempfile.mkdtemp(prefix="kvx")
    process = DaemonProcess("helm-test", socket_dir=workdir)
    yield process
    process.terminate()
    shutil.rmtree(workdir, ignore_errors=True)


def test_the_script_fails_a_daemon_without_its_engine_then_passes_it_with_one(daemon):
    script = _test_pod()["spec"]["containers"][0]["args"][0]
    port = int(daemon.addresses["metrics"].rsplit(":", 1)[1].split("/")[0])
    idle = _run(script, [["localhost", [port], 1]])
    assert idle.returncode == 1 and "FAIL" in idle.stdout and "kvxferd_engines_registered 0.0" in idle.stdout
    (nobody,) = free_ports(1)
    down = _run(script, [["localhost", [nobody], 1]])
    assert down.returncode == 1 and "FAIL" in down.stdout  # no daemon answers there
    # A role whose Service has no ready pod (no DNS answer), or fewer than its replicas, fails; replicas 0 is skipped.
    missing = _run(script, [["kvx-nowhere-peers.invalid", [port], 1]])
    assert missing.returncode == 1 and "FAIL kvx-nowhere-peers.invalid" in missing.stdout, missing.stderr
    assert _run(script, [["kvx-nowhere-peers.invalid", [port], 0]]).returncode == 0
    arenas = []
    client = EngineClient(daemon.engine_target)
    client.register(engine_pb(GQA_GROUPS[0], "helm-test-engine", arenas))
    try:
        ready = _run(script, [["localhost", [port], 1]])
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert ready.stdout.startswith("ok ") and "kvxferd_engines_registered 1.0" in ready.stdout
        short = _run(script, [["localhost", [port], 3]])  # localhost is one address, not 3 ready pods
        assert short.returncode == 1 and "1 of 3 pods ready" in short.stdout
    finally:
        client.close()
        for arena in arenas:
            arena.close()
