"""linkdelay.py: packets of one host's link held back in user space (no netem in this kernel), never lost.

The namespace tests are skipped with the reason where namespaces cannot be
made (not root, no ``ip`` or ``iptables-legacy``); CI runs as root.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvxferd.rig.verify.hosts import linkdelay
from kvxferd.rig.verify.hosts.fabric import IPTABLES, Fabric, unavailable
from kvxferd.rig.verify.hosts.linkfaults import LinkFaults
from kvxferd.rig.verify.hosts.nsenter import call_in_netns, setns_thread

REASON = unavailable()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"namespace hosts: {REASON}")
PROBE = os.path.join(os.path.dirname(__file__), "probe.py")
QUEUE = 9  # not LinkFaults' 7: the in-process test binds its own queue
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33


@pytest.fixture
def pair():
    with Fabric(2) as fabric:
        faults = LinkFaults(fabric)
        try:
            yield fabric, faults
        finally:
            faults.close()


def _server(fabric, host, kind: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen(fabric.command(host, sys.executable, PROBE, kind, host.address, str(port)),
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def _rtt_ms(fabric, port: int) -> float:
    a, b = fabric.hosts
    server = _server(fabric, b, "serve", port)
    try:
        return float(fabric.run(a, sys.executable, PROBE, "rtt", b.address, str(port), "21").stdout)
    finally:
        server.wait(10)


@needs_hosts
def test_delay_holds_each_packet_and_clearing_ends_it(pair):
    fabric, faults = pair
    a = fabric.hosts[0]
    assert _rtt_ms(fabric, 47501) < 10.0  # the control: a veth round trip is well under a millisecond
    faults.delay(a, 0.05)
    assert _rtt_ms(fabric, 47502) >= 45.0  # a's packets out wait 50 ms; b's answers do not
    faults.clear(a)
    assert _rtt_ms(fabric, 47503) < 10.0


@needs_hosts
def test_reordered_and_delayed_bytes_arrive_whole(pair):
    fabric, faults = pair
    a, b = fabric.hosts
    faults.delay(a, 0.005, jitter_s=0.005, reorder=0.3)
    sink = _server(fabric, b, "sink", 47510)
    sent = fabric.run(a, sys.executable, PROBE, "send", b.address, "47510", str(20 << 20)).stdout.strip()
    received, _ = sink.communicate(timeout=60)
    assert received.strip() == sent


@needs_hosts
def test_loss_and_partition_drop_and_clear_restores(pair):
    fabric, faults = pair
    a, b = fabric.hosts
    probe = [sys.executable, PROBE, "tcp", b.address, "47520"]
    server = _server(fabric, b, "serve", 47520)
    faults.partition(a, b)
    assert fabric.run(a, *probe).stdout.strip() == "timeout"
    faults.clear(a)
    faults.clear(b)
    assert fabric.run(a, *probe).stdout.strip() == "connected"
    server.wait(10)
    faults.loss(a, 0.15)
    _rtt_ms(fabric, 47521)  # TCP carries the pings through the loss, retransmitting
    listed = fabric.run(a, "iptables-legacy", "-w", "-L", "KVX-FAULT", "-n", "-v", "-x").stdout
    dropped = sum(int(line.split()[0]) for line in listed.splitlines() if " DROP " in f" {line} ")
    assert dropped > 0, listed
    with pytest.raises(ValueError):
        faults.loss(a, 1.5)


def _udp_socket(bind: tuple[str, int] | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Held packets count against the sender's buffer and arrive at once: room for all of them at both ends.
    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 16 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    if bind is not None:
        sock.bind(bind)
    return sock


def _received(sock: socket.socket, timeout_s: float) -> set[int]:
    numbers = set()
    sock.settimeout(timeout_s)
    try:
        while True:
            numbers.add(int(sock.recv(64)))
    except socket.timeout:
        return numbers


@needs_hosts
def test_in_process_run_holds_until_stopped_then_lets_every_packet_go():
    """run() in a thread of this process: UDP (never retransmitted) shows that stopping loses nothing,
    neither the packets held nor those arriving while it stops."""
    with Fabric(2) as fabric:
        a, b = fabric.hosts
        receiver = call_in_netns(b.netns, _udp_socket, (b.address, 47530))
        sender = call_in_netns(a.netns, _udp_socket)
        stop, bound, outcome = threading.Event(), threading.Event(), {}

        def delayer() -> None:
            try:
                setns_thread(a.netns)
                outcome["held"] = linkdelay.run(QUEUE, 30.0, stop=stop, ready=bound.set)
            except BaseException as err:  # noqa: BLE001 - reported by the test
                outcome["error"] = err
                bound.set()

        thread = threading.Thread(target=delayer, daemon=True)
        try:
            sender.sendto(b"-1", (b.address, 47530))  # the control (and b's address resolved before the hold)
            assert _received(receiver, 2.0) == {-1}
            thread.start()
            assert bound.wait(10) and "error" not in outcome, outcome
            fabric.run(a, IPTABLES, "-w", "-A", "OUTPUT", "-o", a.interface, "-j", "NFQUEUE", "--queue-num",
                       str(QUEUE), "--queue-bypass")
            for number in range(200):
                sender.sendto(b"%d" % number, (b.address, 47530))
            assert _received(receiver, 0.5) == set()  # held: 30 s to go
            for number in range(200, 1400):  # stopped in the middle of a stream: some arrive as it unbinds
                if number == 600:
                    stop.set()
                sender.sendto(b"%d" % number, (b.address, 47530))
                time.sleep(0.0002)
            thread.join(5)
            assert not thread.is_alive() and "error" not in outcome, outcome
            assert outcome["held"] >= 600
            lost = sorted(set(range(1400)) - _received(receiver, 1.0))
            assert not lost, f"{len(lost)} of 1400 datagrams lost: {lost[:20]}"
        finally:
            stop.set()
            if thread.ident is not None:
                thread.join(5)
            sender.close()
            receiver.close()


@pytest.mark.parametrize("argv, message", [
    (["--queue", "70000", "--delay-ms", "1"], "--queue: must be in 0..65535, got 70000"),
    (["--queue", "1", "--delay-ms", "-5"], "--delay-ms: must be >= 0, got -5"),
    (["--queue", "1", "--delay-ms", "1", "--reorder", "1.5"], "--reorder: must be in [0, 1], got 1.5"),
    (["--queue", "1", "--delay-ms", "soon"], "--delay-ms: 'soon' is not a number"),
])
def test_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        linkdelay.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="reorder"):
        linkdelay.LinkDelay(1, 0.01, reorder=-0.1)
