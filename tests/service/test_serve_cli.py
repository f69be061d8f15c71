"""``kvxferd serve``: loopback defaults, exit codes for bad configuration and failed start-up."""

import json
import os
import signal
import subprocess
import sys

import pytest

from kvxferd.client import DaemonProcess
from kvxferd.client.launch import port_is_free
from kvxferd.xfer.osutil.fdtable import RESERVED_FDS
from kvxferd.wire.names import default_engine_socket


def test_no_options_starts_on_loopback_defaults():
    if not all(port_is_free(p) for p in (47100, 47200, 9464)):
        pytest.skip("a default port is taken on this machine")
    process = subprocess.Popen([sys.executable, "-m", "kvxferd", "serve"], stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.DEVNULL)
    try:
        line = process.stdout.readline()
        assert line.startswith("kvxferd ready: ")
        assert f"engine=unix:{default_engine_socket()}" in line and "peer=127.0.0.1:47100" in line
        assert "notify=tcp://127.0.0.1:47200" in line and "metrics=http://127.0.0.1:9464/metrics" in line
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


def test_bad_configuration_exits_2_naming_the_option():
    run = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--peer-host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "advertise_host" in run.stderr


def test_start_up_failure_exits_3(workdir):
    first = DaemonProcess("busy-a", socket_dir=workdir)
    try:
        port = first.peer_address.rsplit(":", 1)[1]
        run = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--engine-socket", f"{workdir}/busy-b.sock",
                              "--peer-port", port, "--notify-port", "0", "--metrics-port", "0"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 3 and "start-up failed" in run.stdout and port in run.stdout
        run = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--engine-socket", first.socket,
                              "--peer-port", "0", "--notify-port", "0", "--metrics-port", "0"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 3 and "already serves the engine socket" in run.stdout
        for path in (first.socket, first.socket + ".fds", first.socket + ".reads"):  # left alone
            assert os.path.exists(path), path
    finally:
        assert first.terminate() == 0


def test_health_command_answers_for_a_live_daemon_only(workdir):
    def health(*args, env=None):
        return subprocess.run([sys.executable, "-m", "kvxferd", "health", *args], capture_output=True, text=True,
                              timeout=60, env=env)
    daemon = DaemonProcess("health", socket_dir=workdir)
    try:
        with open(f"/proc/{daemon.process.pid}/status") as status:  # grown at start-up (fdtable.py)
            assert int(next(line for line in status if line.startswith("FDSize:")).split()[1]) >= RESERVED_FDS
        task_dir = f"/proc/{daemon.process.pid}/task"
        names = {open(f"{task_dir}/{tid}/comm").read().strip() for tid in os.listdir(task_dir)}
        assert {"kvx-dataplane", "kvx-fd-inbox"} <= names, names  # its own threads, named for top -H
        for args in (("--target", daemon.peer_address), ("--target", daemon.engine_target),
                     ("--target", daemon.peer_address, "--service", "kvxfer.v1.PeerService")):
            run = health(*args)
            assert run.returncode == 0 and "SERVING" in run.stdout, (args, run.stderr)
        # no --target: the engine socket the environment names (what the image's HEALTHCHECK relies on)
        run = health(env={**os.environ, "KVXFERD_ENGINE_SOCKET": daemon.socket})
        assert run.returncode == 0 and f"unix:{daemon.socket}" in run.stdout, run.stderr
        run = health("--target", daemon.peer_address, "--service", "no.such.Service")
        assert run.returncode == 1 and "NOT_FOUND" in run.stderr
    finally:
        port = daemon.peer_address.rsplit(":", 1)[1]
        daemon.terminate()
    run = health("--target", f"127.0.0.1:{port}", "--timeout-s", "1")
    assert run.returncode == 1 and "UNREACHABLE" in run.stderr


def test_serving_records_name_live_daemons_of_this_mount_namespace_only(tmp_path, monkeypatch):
    """Issue 39: the image's HEALTHCHECK asked a fixed socket and failed for `serve --engine-socket ...`."""
    from kvxferd.client import health
    from kvxferd.wire import serving

    path = serving.write_record(str(tmp_path), "gpu0.sock")  # relative: recorded absolute
    assert serving.live_engine_sockets(str(tmp_path)) == [os.path.abspath("gpu0.sock")]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    namespace = serving.mount_namespace()
    stale = {
        f"serving.{namespace}.{dead.stdout.strip()}": {"engine_socket": "/gone.sock", "pid": int(dead.stdout)},
        f"serving.{namespace}.{os.getppid()}": {"engine_socket": "/reused.sock", "pid": os.getppid(), "start": "1"},
        f"serving.1{namespace}.{os.getpid()}": {"engine_socket": "/neighbour.sock", "pid": os.getpid()},
        f"serving.{namespace}.{os.getpid()}.tmp": {"engine_socket": "/scratch.sock", "pid": os.getpid()},
    }
    for name, record in stale.items():
        (tmp_path / name).write_text(json.dumps(record))
    (tmp_path / f"serving.{namespace}.1").write_text("not json")
    assert serving.live_engine_sockets(str(tmp_path)) == [os.path.abspath("gpu0.sock")]

    monkeypatch.setenv("KVXFERD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVXFERD_ENGINE_SOCKET", raising=False)
    assert health.default_targets() == [f"unix:{os.path.abspath('gpu0.sock')}"]
    monkeypatch.setenv("KVXFERD_ENGINE_SOCKET", "/explicit.sock")  # the environment names one: that one
    assert health.default_targets() == ["unix:/explicit.sock"]
    monkeypatch.delenv("KVXFERD_ENGINE_SOCKET")
    serving.remove_record(path)
    serving.remove_record(path)  # gone already is fine
    assert health.default_targets() == [health.default_target()]
    serving.prune(str(tmp_path), "/neighbour.sock")  # its socket is ours now; the dead and the reused pid's go too
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"serving.{namespace}.1", f"serving.{namespace}.{os.getpid()}.tmp"]


def test_health_without_target_finds_a_daemon_serving_on_any_engine_socket(workdir):
    runtime_dir = os.path.join(workdir, "run")  # records here, not in this host's shared runtime directory
    env = {**os.environ, "KVXFERD_RUNTIME_DIR": runtime_dir}
    env.pop("KVXFERD_ENGINE_SOCKET", None)

    def health():
        return subprocess.run([sys.executable, "-m", "kvxferd", "health"], capture_output=True, text=True,
                              timeout=60, env=env)
    daemon = DaemonProcess("gpu0", socket_dir=workdir, env={"KVXFERD_RUNTIME_DIR": runtime_dir})
    try:
        assert not daemon.socket.startswith(runtime_dir)
        run = health()
        assert run.returncode == 0 and f"unix:{daemon.socket} (daemon): SERVING" in run.stdout, run.stderr
    finally:
        assert daemon.terminate() == 0
    assert not [name for name in os.listdir(runtime_dir) if name.startswith("serving.")]
    run = health()
    assert run.returncode == 1 and "UNREACHABLE" in run.stderr


def test_generated_curve_keys_that_begin_with_a_dash_are_taken(tmp_path):
    """Issue 61: the documented `kvxferd serve --notify-curve-secret-key "$SECRET" --notify-client-keys
    "$PUBLIC"` exited 2 ("expected one argument") for about 1 key in 85, those beginning with "-". Drawn as a
    client would (pyzmq only): keys made until both begin with "-", the daemon started with them as the docs
    say, and a CURVE subscriber with them completes its handshake with the daemon's key."""
    import re

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    def keypair_beginning_with_dash(which: int) -> tuple[bytes, bytes]:
        while True:
            pair = zmq.curve_keypair()
            if pair[which].startswith(b"-"):
                return pair

    _, server_secret = keypair_beginning_with_dash(1)
    client_public, client_secret = keypair_beginning_with_dash(0)
    process = subprocess.Popen([sys.executable, "-m", "kvxferd", "serve", "--peer-port", "0", "--notify-port", "0",
                                "--metrics-port", "0", "--engine-socket", str(tmp_path / "curve.sock"),
                                "--notify-curve-secret-key", server_secret.decode(),
                                "--notify-client-keys", client_public.decode()],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    context = zmq.Context()
    try:
        line = process.stdout.readline()
        assert line.startswith("kvxferd ready: "), process.stderr.read()
        notify = re.search(r"notify=(\S+)", line).group(1)

        def handshake(server_key: bytes) -> bool:
            sub = context.socket(zmq.SUB)
            sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = server_key, client_public, client_secret
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            sub.connect(notify)
            try:
                return monitor.poll(3_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            finally:
                sub.disable_monitor()
                sub.close(0)

        assert handshake(zmq.curve_public(server_secret))
        assert not handshake(zmq.curve_keypair()[0])  # the control: another server key does not pass
    finally:
        context.destroy(0)
        process.send_signal(signal.SIGTERM)
        process.wait(30)
