"""Issue 53, "Info": the chart's sockets admit the engine's uid alone, and the engine cannot rename them.

In the chart's pods the engine and the daemons run as different uids and share the pod's ``fsGroup``.

* The engine socket was 0660 in ``fsGroup`` (``engine_socket_group``): every container of the pod has that
  group, so any of them reached the gRPC engine socket (the fd and reads sockets admit only
  ``allowed_uids`` by ``SO_PEERCRED``, after the connect). Now each socket carries a POSIX ACL entry for
  the engine's uid alone and the chart shares no group: another uid is refused at ``connect``.
* The sockets and the peer secret live in the pod's ``emptyDir``, writable by every uid that mounts it
  and not sticky: the engine's uid renamed the daemons' sockets and the peer secret. Now the engine
  mounts it read-only (``connect`` needs no write access to the mount).
* A shm object the daemon's user cannot open answered ``INVALID_ARGUMENT``, where protocol.md's table says
  ``PERMISSION_DENIED``.

The daemon runs as the chart's daemon uid with the socket settings of the chart's rendered ConfigMap, in a
directory laid out as kubelet lays out an emptyDir; the engine and "another container" are processes of
the chart's uids with the pod's fsGroup (the tests run as root).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import grpc
import pytest
import yaml

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.rig.verify import chart
from kvxferd.rig.verify.models import ModelShape, model_groups
from kvxferd.wire.names import SHM_DIR
from tests.service.helpers import engine_pb, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())
CLONE_NEWNS = 0x00020000
pytestmark = pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv") or chart.unavailable() is not None,
                                reason="playing the pod's uids needs root and setpriv; the chart needs helm-python-sdk")


@pytest.fixture(scope="module")
def pod():
    """What the chart's first Deployment says about users, groups, the sockets' mount and their admission."""
    objects = chart.render_objects()
    spec = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["kvxferd.yaml"])
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    daemon = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"].startswith("kvxferd-"))
    (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "sockets"]
    return {"fs_group": int(spec["securityContext"]["fsGroup"]),
            "engine": (int(engine["securityContext"]["runAsUser"]), int(engine["securityContext"]["runAsGroup"])),
            "daemon": (int(daemon["securityContext"]["runAsUser"]), int(daemon["securityContext"]["runAsGroup"])),
            "engine_mount_read_only": bool(mount.get("readOnly", False)),
            "group": config.get("engine_socket_group"), "allowed_uids": [int(u) for u in config.get("allowed_uids", [])]}


@pytest.fixture(scope="module")
def sockets(pod):
    """A kubelet emptyDir (root's, every uid may write, the fsGroup's setgid bit) with a daemon of the chart's
    uid serving in it, with the chart's socket settings; its peer secret there too (the chart's runtime dir)."""
    home = tempfile.mkdtemp(prefix="kvp")
    os.chmod(home, 0o755)
    directory = os.path.join(home, "run-kvxferd")
    os.mkdir(directory)
    os.chown(directory, 0, pod["fs_group"])
    os.chmod(directory, 0o2777)
    uid, gid = pod["daemon"]
    flags = ["--engine-socket", os.path.join(directory, "gpu0.sock"), "--runtime-dir", directory]
    if pod["allowed_uids"]:
        flags += ["--allowed-uids", ",".join(map(str, pod["allowed_uids"]))]
    if pod["group"] is not None:
        flags += ["--engine-socket-group", str(pod["group"])]
    daemon = DaemonProcess("pod", socket_dir=home, extra_args=tuple(flags), env={"HOME": directory},
                           prefix=("setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={pod['fs_group']}"))
    daemon.directory = directory
    yield daemon
    daemon.terminate()
    shutil.rmtree(home, ignore_errors=True)


def _as(uid: int, gid: int, groups: list[int], fn, *, read_only: str | None = None) -> str:
    """Run ``fn`` (returning text) in a child of ``uid``/``gid`` with supplementary ``groups``; with
    ``read_only``, in its own mount namespace where that directory is mounted read-only (a volumeMount
    with readOnly: true). Returns what ``fn`` returned."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = "error"
        try:
            if read_only is not None:
                libc = ctypes.CDLL(None, use_errno=True)
                assert libc.unshare(CLONE_NEWNS) == 0
                for args in (["--make-rprivate", "/"], ["--bind", read_only, read_only],
                             ["-o", "remount,bind,ro", read_only]):
                    subprocess.run(["mount", *args], check=True)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        finally:
            os.write(write_fd, out.encode())
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as result:
        return result.read().decode()


def _connect_all(paths: list[str]):
    def connect():
        outcomes = []
        for path in paths:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                outcomes.append("connected")
            except OSError as err:
                outcomes.append(type(err).__name__)
            finally:
                sock.close()
        return ",".join(outcomes)
    return connect


def _health_as(pod, uid: int, gid: int, target: str) -> subprocess.CompletedProcess:
    """``kvxferd health`` as a process of the pod (the engine's environment names the daemons' uid)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={pod['fs_group']}",
                           sys.executable, "-m", "kvxferd", "health", "--target", f"unix:{target}"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVXFERD_DAEMON_UID": str(pod["daemon"][0])})


def test_another_container_of_the_pod_cannot_reach_the_engine_socket(pod, sockets):
    paths = [sockets.socket, sockets.socket + ".fds", sockets.socket + ".reads"]
    stranger = (pod["engine"][0] + 1, pod["engine"][1] + 1)  # a sidecar: another uid, the pod's fsGroup
    assert _as(*stranger, [pod["fs_group"]], _connect_all(paths)) == "PermissionError,PermissionError,PermissionError"
    health = _health_as(pod, *stranger, sockets.socket)
    assert health.returncode != 0 and "SERVING" not in health.stdout, health
    # The control: the engine's uid connects to all three and is served.
    assert _as(*pod["engine"], [pod["fs_group"]], _connect_all(paths)) == "connected,connected,connected"
    health = _health_as(pod, *pod["engine"], sockets.socket)
    assert health.returncode == 0 and "SERVING" in health.stdout, health


def test_the_engine_cannot_rename_the_sockets_or_the_peer_secret(pod, sockets):
    directory = sockets.directory
    assert os.path.exists(os.path.join(directory, "peer.secret"))
    mount = directory if pod["engine_mount_read_only"] else None

    def rename():
        outcomes = []
        for name in ("gpu0.sock", "gpu0.sock.reads", "peer.secret"):
            path = os.path.join(directory, name)
            try:
                os.rename(path, path + ".moved")
                os.rename(path + ".moved", path)  # put it back: the test's own cleanup
                outcomes.append("renamed")
            except OSError as err:
                outcomes.append(type(err).__name__)
        return ",".join(outcomes)

    assert _as(*pod["engine"], [pod["fs_group"]], rename, read_only=mount) == "OSError,OSError,OSError"
    # The control: through the read-only mount the engine still connects.
    assert _as(*pod["engine"], [pod["fs_group"]], _connect_all([sockets.socket, sockets.socket + ".reads"]),
               read_only=mount) == "connected,connected"


def test_a_shm_object_the_daemon_cannot_open_is_permission_denied(pod, sockets):
    arenas = []
    client = EngineClient(sockets.engine_target, daemon_uid=pod["daemon"][0], timeout_s=30)
    try:
        message = engine_pb(GROUPS[0], "unopenable", arenas)
        path = SHM_DIR / arenas[-1].name
        assert (os.stat(path).st_uid, os.stat(path).st_mode & 0o777) == (0, 0o600)  # root's: not the daemon's
        code, details = status(lambda: client.register(message, lease_s=30))
        assert code == C.PERMISSION_DENIED and "shm_name" in details, (code, details)
        # The control: the engine's own object, which the daemons may open through the pod's group, registers.
        os.chown(path, pod["engine"][0], pod["fs_group"])
        os.chmod(path, 0o660)
        client.register(message, lease_s=30)
        client.deregister()
    finally:
        client.close()
        for arena in arenas:
            arena.close()


def test_an_allowed_uid_cannot_have_the_daemons_own_objects_opened(pod, sockets):
    """What the engine's uid may name (it reaches the engine socket through its ACL entry): only objects it
    could open itself. An object of the daemons' user (UCX's own shm segments are such) is refused, as it
    was when the engine reached the socket through the group: the ACL widens nothing."""
    arenas = []
    client = EngineClient(sockets.engine_target, daemon_uid=pod["daemon"][0], timeout_s=30)
    try:
        message = engine_pb(GROUPS[0], "daemons-own", arenas)
        path = SHM_DIR / arenas[-1].name
        os.chown(path, pod["daemon"][0], pod["daemon"][1])  # the daemons' user's, 0600: as UCX makes its own
        code, details = status(lambda: client.register(message, lease_s=30))
        assert code == C.PERMISSION_DENIED and "shm_fd_index" in details, (code, details)
    finally:
        client.close()
        for arena in arenas:
            arena.close()
