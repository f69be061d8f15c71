"""The engine's lifetime decides how long the daemon maps its memory: an engine killed with SIGKILL is let go
of at once (its pidfd, passed by the connector), every mapping of its cache gone from the daemon within 5 s.

The engine is a real process running the vLLM connector's worker side (host memory: torch's shared-memory
files, passed as fds); its lease (15 s) is longer than the 5 s allowed. The negative control ties the
registration to another process's pidfd: the same kill then leaves the cache mapped past the 5 s.
(The daemon restarted under a running engine: test_vllm_pieces.py's reshare test.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvxferd.client import DaemonProcess
from kvxferd.rig.daemons import dataplane_workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_BLOCKS = 256  # 2 layers x 256 blocks x 32 KiB: 16 MiB of cache
DROP_S = 5.0


def cache_mappings(daemon_pid: int, engine_pid: int) -> list[str]:
    """A daemon process's mappings of the engine's cache (torch names its shared memory torch_<pid>_...)."""
    try:
        with open(f"/proc/{daemon_pid}/maps") as maps:
            return [line for line in maps if f"torch_{engine_pid}_" in line]
    except FileNotFoundError:  # a worker that exited maps nothing
        return []


def shared_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssShmem:"))


def start_engine(daemon: DaemonProcess, engine_id: str, *lifeline) -> tuple[subprocess.Popen, int]:
    engine = subprocess.Popen([sys.executable, "-m", "tests.integrations.engine_child", daemon.socket, engine_id,
                               str(NUM_BLOCKS), *map(str, lifeline)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = engine.stdout.readline()
    assert line.startswith("registered"), (line, daemon.tail(2000))
    return engine, int(line.split()[1])


def wait_for(condition, timeout_s: float) -> float | None:
    """Seconds until ``condition()`` held, or None if it did not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


@pytest.fixture
def daemon(tmp_path):
    daemon = DaemonProcess("life", socket_dir=str(tmp_path))
    yield daemon
    daemon.terminate()


def test_engine_death_unmaps_its_cache_within_seconds(daemon):
    rss_before = shared_rss_bytes(daemon.process.pid)
    engine, cache_bytes = start_engine(daemon, "dies")
    assert cache_mappings(daemon.process.pid, engine.pid), "the daemon maps the engine's cache"
    assert shared_rss_bytes(daemon.process.pid) - rss_before >= 0.9 * cache_bytes  # populated at registration
    rss_held = shared_rss_bytes(daemon.process.pid)
    engine.send_signal(signal.SIGKILL)
    engine.wait()
    took_s = wait_for(lambda: not cache_mappings(daemon.process.pid, engine.pid), DROP_S)
    assert took_s is not None, f"still mapped {DROP_S} s after the engine died: {daemon.tail(2000)}"
    # The pages went with it (what stays is UCX's own shared memory, made with the first agent).
    assert rss_held - shared_rss_bytes(daemon.process.pid) >= 0.9 * cache_bytes
    assert wait_for(lambda: daemon.metric("kvxferd_engines_registered") == 0, 1.0) is not None
    assert "engine process exited" in daemon.tail()


def test_engine_death_unmaps_its_cache_in_data_plane_workers_too(tmp_path):
    """With data-plane workers, the workers map the engine's cache as well (from the daemon's copies of its
    fds): every process of the daemon lets go of it within the 5 s."""
    daemon = DaemonProcess("lifew", socket_dir=str(tmp_path),
                           extra_args=("--dataplane-workers", "--dataplane-reader-workers"))
    try:
        engine, _ = start_engine(daemon, "dies-served")

        def processes() -> list[int]:
            return [daemon.process.pid, *dataplane_workers(daemon.process.pid)]

        assert wait_for(lambda: len(processes()) == 3 and all(cache_mappings(p, engine.pid) for p in processes()),
                        10.0) is not None, [(p, bool(cache_mappings(p, engine.pid))) for p in processes()]
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        assert wait_for(lambda: not any(cache_mappings(p, engine.pid) for p in processes()), DROP_S) is not None, \
            [(p, len(cache_mappings(p, engine.pid))) for p in processes()]
    finally:
        daemon.terminate()


def test_engine_death_control_without_its_own_pidfd_stays_mapped(daemon):
    """The control: the registration watches another process (a sleeper); the engine's death then goes
    unnoticed until its lease (15 s) runs out: still mapped after 5 s."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        engine, _ = start_engine(daemon, "dies-unwatched", sleeper.pid)
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        assert wait_for(lambda: not cache_mappings(daemon.process.pid, engine.pid), DROP_S) is None
        assert daemon.metric("kvxferd_engines_registered") == 1
        sleeper.kill()  # the process it watches exits: now it is let go of
        assert wait_for(lambda: not cache_mappings(daemon.process.pid, engine.pid), DROP_S) is not None
    finally:
        sleeper.kill()
