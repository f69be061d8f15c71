"""Issue 11, attack 10 and unsafe set-ups: what a daemon exposes, and what it refuses to expose.

* A peer port or notify bus on a non-loopback address without TLS/CURVE is
  refused at start (exit 2, one line), unless ``--insecure``, which warns and
  sets ``kvxferd_insecure_listeners``.
* With the defaults every TCP listener of the daemon, UCX's included, is on
  loopback (UCX alone listened on every interface before).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.service.net.exposure import is_loopback
from kvxferd.rig.verify.models import ModelShape, model_groups
from tests.service.helpers import engine_pb
from tests.sockets import listening_sockets

SERVE = [sys.executable, "-m", "kvxferd", "serve", "--peer-port", "0", "--notify-port", "0", "--metrics-port", "0"]


def non_loopback_address() -> str:
    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            if entry.family == socket.AF_INET and not is_loopback(entry.address):
                return entry.address
    pytest.skip("this machine has no non-loopback IPv4 address")


@pytest.mark.parametrize("exposed", [["--peer-host", "0.0.0.0", "--advertise-host", "127.0.0.1"],
                                     ["--notify-host", "0.0.0.0"]], ids=["peer", "notify"])
def test_an_unauthenticated_listener_off_loopback_is_refused(exposed, workdir):
    result = subprocess.run([*SERVE, "--engine-socket", f"{workdir}/refused.sock", *exposed],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxferd: refusing to start:") and "--insecure" in lines[0], lines
    assert not os.path.exists(f"{workdir}/refused.sock")


def test_insecure_starts_warns_and_counts(workdir):
    host = non_loopback_address()
    daemon = DaemonProcess("insecure", socket_dir=workdir, extra_args=(
        "--peer-host", host, "--notify-host", host, "--insecure"))
    try:
        assert daemon.metric("kvxferd_insecure_listeners") == 2
        assert "INSECURE" in daemon.tail()
    finally:
        daemon.terminate()


def _is_loopback_hex(address: str) -> bool:
    if len(address) == 8:  # IPv4, little-endian
        return address.endswith("7F")
    # ::1, or 127.0.0.1 mapped into IPv6 (::ffff:127.0.0.1)
    return address == "00000000000000000000000001000000" or address == "0000000000000000FFFF00000100007F"


def test_every_listener_of_a_default_daemon_is_on_loopback(workdir):
    daemon = DaemonProcess("loop", socket_dir=workdir)
    try:
        arenas = []
        client = EngineClient(daemon.engine_target)
        client.register(engine_pb(model_groups("gqa", ModelShape())[0], "loop-engine", arenas))  # creates the NIXL agent
        try:
            found = [address for address, _ in listening_sockets(daemon.process.pid)]
            assert len(found) >= 4, found  # peer, notify, metrics, UCX
            assert all(_is_loopback_hex(a) for a in found), found
        finally:
            client.deregister()
            client.close()
            for arena in arenas:
                arena.close()
    finally:
        daemon.terminate()
