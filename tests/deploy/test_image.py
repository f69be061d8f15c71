"""The container image, built and run here (marker ``image``: ``scripts/test.sh -m image tests/deploy/test_image.py``).

scripts/build_image.sh builds it without a registry (podman, a debootstrap
base, torch's CPU wheel from /opt/wheels), once per module; a cached build
takes seconds. Then, in containers with no network but loopback:
``kvxferd health`` (the image's HEALTHCHECK) finds a daemon started as the
chart starts it, on /run/kvxferd/gpu0.sock; the demo moves every preset
byte-exact with room in /dev/shm, and with the runtimes' default 64 MB says
so in one line before it starts anything (issue 39).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import pytest

from kvxferd.rig.verify.models import MODELS

pytestmark = pytest.mark.image
ROOT = pathlib.Path(__file__).resolve().parents[2]
TAG = os.environ.get("KVXFERD_TEST_IMAGE", "kvxferd:latest")
BUILD_TIMEOUT_S = 3600  # a cold build on two cores: about 2 minutes, more on a slow mirror


def podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        pytest.skip("building the image needs root (debootstrap, rootful podman): run scripts/build_image.sh as root")
    build = subprocess.run([str(ROOT / "scripts" / "build_image.sh"), "--tag", TAG], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
    if build.returncode == 3:  # no root, podman or debootstrap cannot be installed, podman does not run here
        pytest.skip(f"the image cannot be built here: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr[-4000:]
    return TAG


def _wait_for_log(name: str, text: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = podman("logs", name)
        if text in logs.stdout:
            return logs.stdout
        time.sleep(0.5)
    raise AssertionError(f"{name} never printed {text!r}: {logs.stdout[-2000:]}{logs.stderr[-2000:]}")


def test_health_check_finds_the_daemon_on_the_engine_socket_its_flags_name(image):
    name = f"kvxferd-health-{os.getpid()}"
    started = podman("run", "-d", "--name", name, "--network", "none", image, "serve",
                     "--engine-socket", "/run/kvxferd/gpu0.sock")
    assert started.returncode == 0, started.stderr
    try:
        _wait_for_log(name, "kvxferd ready: engine=unix:/run/kvxferd/gpu0.sock")
        check = podman("healthcheck", "run", name)  # the image's HEALTHCHECK, as the runtime runs it
        assert check.returncode == 0 and "unhealthy" not in check.stdout, (check.stdout, check.stderr)
        health = podman("exec", name, "kvxferd", "health")
        assert health.returncode == 0, health.stderr
        assert health.stdout.strip() == "unix:/run/kvxferd/gpu0.sock (daemon): SERVING"
        # The socket the image's environment used to name: nobody serves it (the bug, as the check saw it).
        fixed = podman("exec", name, "kvxferd", "health", "--target", "unix:/run/kvxferd/engine.sock",
                       "--timeout-s", "1")
        assert fixed.returncode == 1 and "UNREACHABLE" in fixed.stderr
    finally:
        podman("rm", "-f", "-t", "5", name)


def test_demo_moves_every_preset_byte_exact_with_room_in_dev_shm(image):
    demo = podman("run", "--rm", "--network", "none", "--shm-size=1g", image, "demo", timeout_s=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    rows = {line.split()[0]: line for line in demo.stdout.splitlines() if line.split()[:1] and line.split()[0] in MODELS
            and "->" in line}
    assert sorted(rows) == sorted(MODELS), demo.stdout
    assert all(line.rstrip().endswith("byte-exact") for line in rows.values()), demo.stdout
    assert "0 bytes wrong; 0 failed requests" in demo.stdout


def test_demo_in_the_default_64m_dev_shm_says_free_needed_and_the_fix(image):
    demo = podman("run", "--rm", "--network", "none", "--shm-size=64m", image, "demo")
    assert demo.returncode == 2, demo.stdout[-3000:] + demo.stderr[-3000:]
    (line,) = [line for line in demo.stderr.splitlines() if line.startswith("kvxferd demo:")]
    assert "/dev/shm has" in line and "MiB free, the demo needs about" in line and "--shm-size=1g" in line
    assert "kvxferd daemons" not in demo.stderr  # refused before anything started
