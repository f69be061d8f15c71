"""The container image, built and run here (marker ``image``: ``scripts/test.sh -m image tests/deploy/test_image.py``).

scripts/build_image.sh builds it without a registry (podman, a debootstrap
base), once per module; a cached build takes seconds. It has no torch (issue
#60). Then, in containers with no network but loopback:
``kvxferd health`` (the image's HEALTHCHECK) finds a daemon started as the
chart starts it, on /run/kvxferd/gpu0.sock; the demo moves every preset
byte-exact with room in /dev/shm, and with the runtimes' default 64 MB says
so in one line before it starts anything (issue 39). The CUDA variants (cu12,
cu13) are built too: their NIXL and UCX libraries find the CUDA runtime that
torch used to bring (a GPU is not needed to see the loader resolve them).
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


def build(tag: str, nixl_variant: str = "cpu") -> str:
    """``tag`` built by scripts/build_image.sh (skips where it cannot run); the image's name."""
    if os.geteuid() != 0:
        pytest.skip("building the image needs root (debootstrap, rootful podman): run scripts/build_image.sh as root")
    made = subprocess.run([str(ROOT / "scripts" / "build_image.sh"), "--tag", tag, "--nixl-variant", nixl_variant],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if made.returncode == 3:  # no root, podman or debootstrap cannot be installed, podman does not run here
        pytest.skip(f"the image cannot be built here: {made.stderr.strip().splitlines()[-1]}")
    assert made.returncode == 0, made.stderr[-4000:]
    print(made.stderr.strip().splitlines()[-1])  # its size and build time (pytest -s shows them)
    return tag


@pytest.fixture(scope="module")
def image() -> str:
    return build(TAG)


def in_image(image: str, code: str) -> subprocess.CompletedProcess:
    """``code`` run by the image's Python, as the image's user, with no network."""
    return podman("run", "--rm", "--network", "none", "--entrypoint", "/opt/kvxferd/bin/python", image, "-c", code)


def test_the_image_has_no_torch_and_its_nixl_loads(image):
    found = in_image(image, "import importlib.util as u; print([u.find_spec(m) is not None for m in ('torch', 'nixl')])")
    assert found.returncode == 0 and found.stdout.strip() == "[False, True]", (found.stdout, found.stderr)


UCX = "/opt/kvxferd/lib/python3*/site-packages/nixl_cu1*.libs/ucx"
DRIVER = {"libcuda.so.1", "libnvidia-ml.so.1"}  # the node's driver: the container runtime mounts it


@pytest.mark.parametrize("variant", ["cu12", "cu13", "cpu"])
def test_the_cuda_variants_libraries_find_the_cuda_runtime_without_torch(variant, request):
    """UCX's CUDA memory hooks (libucm_cuda, which its CUDA transports need) link libcudart.so.12/.13, which a
    CUDA torch used to bring: in the cu images the loader resolves it (NVIDIA's runtime wheel), and all
    that UCX's CUDA libraries miss is the driver, which the container runtime mounts from the node. The cpu
    image has no CUDA runtime: its libcudart is not found (the negative control). (NIXL's GDS plugins also
    want cuFile from the node: GPUDirect Storage is not kvxferd's.)"""
    image = request.getfixturevalue("image") if variant == "cpu" else build(f"{TAG.split(':')[0]}:test-{variant}",
                                                                              variant)
    listed = podman("run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", image, "-c",
                    f"for lib in {UCX}/libucm_cuda.so.0.0.0 {UCX}/libuct_cuda.so.0.0.0; do "
                    "echo \"== $lib\"; ldd \"$lib\"; done")
    assert listed.returncode == 0, listed.stderr
    hooks, transports = listed.stdout.split("== ")[1:]
    cudart = [line.split() for line in hooks.splitlines() if "libcudart.so" in line]
    if variant == "cpu":
        assert cudart and cudart[0][2:4] == ["not", "found"], hooks
    else:
        assert cudart and cudart[0][0] == f"libcudart.so.{variant[2:]}" and cudart[0][2].startswith("/opt/kvxferd/"), hooks
        for library in (hooks, transports):
            assert {line.split()[0] for line in library.splitlines() if "not found" in line} <= DRIVER, library


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
    assert "0 bytes wrong;" in demo.stdout and "; 0 failed requests;" in demo.stdout


def test_demo_in_the_default_64m_dev_shm_says_free_needed_and_the_fix(image):
    demo = podman("run", "--rm", "--network", "none", "--shm-size=64m", image, "demo")
    assert demo.returncode == 2, demo.stdout[-3000:] + demo.stderr[-3000:]
    (line,) = [line for line in demo.stderr.splitlines() if line.startswith("kvxferd demo:")]
    assert "/dev/shm has" in line and "MiB free, the demo needs about" in line and "--shm-size=1g" in line
    assert "kvxferd daemons" not in demo.stderr  # refused before anything started
