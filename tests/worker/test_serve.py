"""The worker process on its own channel: bad commands are answered, not fatal; it loads no service code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvxferd.service.workers.spawn import spawn_worker, worker_environment
from kvxferd.wire import workerchannel as channel


@pytest.fixture
def worker():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = spawn_worker(theirs.fileno())
    theirs.close()
    ours.settimeout(60)
    yield ours, process
    process.kill()
    process.wait()
    ours.close()


def ask(sock, message, fds=()):
    channel.send(sock, message, fds)
    return channel.receive(sock)[0]


def test_bad_commands_are_answered_and_the_worker_lives_on(worker, tmp_path):
    sock, process = worker
    sock.send(b"not json")
    assert ask(sock, {"op": "ping"})["op"] == "error"  # the junk's answer comes first
    assert channel.receive(sock)[0] == {"op": "pong"}
    assert ask(sock, {"op": "dance"}) == {"op": "error", "message": "unknown op 'dance'"}
    fd = os.memfd_create("kvx-test")
    os.ftruncate(fd, 1 << 16)
    try:
        bad = [{"name": "w", "poll_interval_s": 1e-3, "regions": []},
               {"name": "", "poll_interval_s": 1e-3, "regions": [{"file": 0, "num_bytes": 4096}]},
               {"name": "w", "poll_interval_s": 0, "regions": [{"file": 0, "num_bytes": 4096}]},
               {"name": "w", "poll_interval_s": 1e-3, "regions": [{"file": 1, "num_bytes": 4096}]},  # no such file
               {"name": "w", "poll_interval_s": 1e-3, "regions": [{"file": 0, "num_bytes": 4096, "offset": -1}]},
               {"name": "w", "poll_interval_s": 1e-3, "regions": ["x"]},
               {"name": "w", "poll_interval_s": 1e-3, "regions": [{"file": 0, "num_bytes": 1 << 20}]}]  # past the end
        for message in bad:
            assert ask(sock, {"op": "map", **message}, [fd])["op"] == "error", message
        good = ask(sock, {"op": "map", "name": "kvx-test-w", "poll_interval_s": 1e-3,
                          "regions": [{"file": 0, "num_bytes": 1000, "offset": 7},
                                      {"file": 0, "num_bytes": 1000, "offset": 8192}]}, [fd])  # one file, two regions
        assert good["op"] == "mapped" and [a % 4096 for a in good["addresses"]] == [7, 0]
        assert good["addresses"][1] - good["addresses"][0] == 8192 - 7  # one mapping of the file
        assert ask(sock, {"op": "pace", "poll_interval_s": 5.0})["op"] == "error"  # beyond the bounds
        channel.send(sock, {"op": "pace", "poll_interval_s": 0.5})  # taken without an answer:
        assert ask(sock, {"op": "ping"}) == {"op": "pong"}  # the next answer is the ping's
        again = ask(sock, {"op": "map", "name": "kvx-test-w2", "poll_interval_s": 1e-3,
                           "regions": [{"file": 0, "num_bytes": 1 << 16}]}, [fd])
        assert again["op"] == "error" and "one engine rank per worker" in again["message"]
    finally:
        os.close(fd)
    channel.send(sock, {"op": "stop"})
    assert process.wait(timeout=30) == 0


def test_a_worker_ends_with_its_channel(worker):
    sock, process = worker
    assert ask(sock, {"op": "ping"}) == {"op": "pong"}
    sock.close()
    assert process.wait(timeout=30) == 0


def test_the_worker_loads_no_grpc_and_none_of_the_services():
    code = ("import sys, kvxferd.worker.serve; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc' or m.startswith('kvxferd.service')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_environment_keeps_what_ucx_and_python_need_and_nothing_of_the_daemons():
    environ = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0",
               "KVXFERD_ENGINE_TOKEN_FILE": "/run/token", "AWS_SECRET_ACCESS_KEY": "x", "SSLKEYLOGFILE": "/tmp/k"}
    assert worker_environment(environ) == {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "PATH": "/bin",
                                           "CUDA_VISIBLE_DEVICES": "0"}
