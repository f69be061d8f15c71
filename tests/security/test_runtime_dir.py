"""Issue 53, L5: another user who makes ``/tmp/kvxferd-<uid>`` first no longer stops that user's daemon.

Without ``$XDG_RUNTIME_DIR`` (and with ``/run`` not writable: a non-root user), a daemon's default runtime
directory is ``/tmp/kvxferd-<uid>``. Anyone may create names in /tmp, and the daemon refused a directory
of someone else's: one ``mkdir`` by another user kept the default daemon from starting, for good. Now the
daemon uses its own fallback ``/tmp/kvxferd-<uid>.<random>``, which only this user can have made, says so
in its log, and engines and ``kvxferd health`` of that user find the socket there by themselves.

The daemon's user and the squatter are played by two uids nobody else uses (the tests run as root).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from kvxferd.client import DaemonProcess

UID, SQUATTER = 54321, 54322
AS_UID = ("setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups")
PRIMARY = f"/tmp/kvxferd-{UID}"
pytestmark = pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                                reason="playing two other uids needs root (and setpriv)")


def _clean() -> None:
    for path in glob.glob(f"{PRIMARY}*"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home():
    """A HOME the daemon's user may write (NIXL and UCX look there), and where its log goes."""
    _clean()
    path = tempfile.mkdtemp(prefix="kvh")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    _clean()


def _as(uid: int, fn) -> None:
    """Run ``fn`` in a child process of ``uid``."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _run_as_user(home: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_UID, sys.executable, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HOME": home})


def _daemon(home: str, name: str) -> DaemonProcess:
    return DaemonProcess(name, socket_dir=home, default_socket=True, prefix=AS_UID, env={"HOME": home},
                         ready_timeout_s=60)


def test_a_squatted_runtime_directory_does_not_stop_the_daemon(home):
    def squat():
        os.mkdir(PRIMARY, 0o700)
        os.mkdir(f"{PRIMARY}.0000", 0o700)  # a look-alike fallback, first by name: not ours either
    _as(SQUATTER, squat)
    assert os.stat(PRIMARY).st_uid == SQUATTER
    daemon = _daemon(home, "squatted")
    second = None
    try:
        runtime_dir = os.path.dirname(daemon.socket)
        assert runtime_dir.startswith(f"{PRIMARY}.") and runtime_dir != f"{PRIMARY}.0000", daemon.socket
        info = os.lstat(runtime_dir)
        assert (info.st_uid, info.st_mode & 0o777) == (UID, 0o700)
        taken = [json.loads(line) for line in daemon.tail(20_000).splitlines()
                 if line.startswith("{") and "runtime directory taken" in line]
        assert taken and taken[0]["squatted_by_uid"] == SQUATTER and taken[0]["runtime_dir"] == runtime_dir, taken
        # Engines and probes of this user find the socket by default, with nothing configured.
        found = _run_as_user(home, "-c", "from kvxferd.wire.names import default_engine_socket as d; print(d('squatted'))")
        assert found.stdout.strip() == daemon.socket, found
        health = _run_as_user(home, "-m", "kvxferd", "health")
        assert health.returncode == 0 and daemon.socket in health.stdout, health
        # A second daemon of the user (its peer secret too) goes to the same fallback.
        second = _daemon(home, "squatted-2")
        assert os.path.dirname(second.socket) == runtime_dir
        assert os.path.exists(os.path.join(runtime_dir, "peer.secret"))
        # Nothing of the user's went into the squatter's directories.
        assert os.listdir(PRIMARY) == [] and os.listdir(f"{PRIMARY}.0000") == []
    finally:
        for process in (daemon, second):
            if process is not None:
                process.terminate()


def test_without_a_squat_the_usual_directory_is_used(home):
    """The control: nobody took it, the daemon makes /tmp/kvxferd-<uid> itself and says nothing."""
    daemon = _daemon(home, "unsquatted")
    try:
        assert os.path.dirname(daemon.socket) == PRIMARY
        assert os.lstat(PRIMARY).st_uid == UID
        assert "runtime directory taken" not in daemon.tail(20_000)
        assert not glob.glob(f"{PRIMARY}.*")
    finally:
        daemon.terminate()
