"""Workers started by the supervisor: they serve the cache they are handed, hold none of the control
plane's secrets (searched with the H1 harness; a fork is the control that finds them), and one killed by a
READ of an unmapped address is followed by a new one that serves the same bytes (real NIXL over UCX/TCP)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvxferd.errors import UnavailableError
from kvxferd.rig.attack.reach import NixlReach, reaches, read_state, search_process_memory
from kvxferd.service.workers.generation import Region, backoff_s
from kvxferd.service.workers.supervisor import WorkerSupervisor
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState, agent_name_of

CACHE_BYTES = 1 << 20
RESTART_BOUND_S = 30.0
GRACE_S = 15.0  # a replaced generation's grace where the test works with it meanwhile  # a new generation serves within this (about 2 s here: kvxferd bench processes)


@pytest.fixture
def cache(monkeypatch):
    """An engine's cache as a memfd with random bytes, and this process's mapping of it."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # as across hosts without RDMA: the lane H1 is about
    fd = os.memfd_create("kvx-test-cache")
    os.ftruncate(fd, CACHE_BYTES)
    view = np.frombuffer(memoryview(__import__("mmap").mmap(fd, CACHE_BYTES)), dtype=np.uint8)
    view[:] = np.random.default_rng(7).integers(0, 256, CACHE_BYTES, dtype=np.uint8)
    yield fd, view
    os.close(fd)


@pytest.fixture
def supervisor(cache):
    notices = []
    supervisor = WorkerSupervisor("kvx-test", [Region(cache[0], CACHE_BYTES)],
                                  on_notices=lambda generation, pairs: notices.extend(pairs))
    supervisor.notices = notices
    yield supervisor
    supervisor.stop()


def read_cache(metadata: bytes, address: int, num_bytes: int) -> np.ndarray:
    """READ a worker's registered cache as an honest peer does (metadata as given)."""
    agent = NixlAgent(f"kvx-test-reader-{time.monotonic_ns()}")
    into = np.zeros(num_bytes, dtype=np.uint8)
    try:
        agent.register_array("into", into)
        name = agent.add_remote(metadata)
        local = agent.prep_local(np.array([[into.ctypes.data, num_bytes, 0, num_bytes, 1]], dtype=np.uint64), "DRAM")
        remote = agent.prep_remote(name, np.array([[address, num_bytes, 0, num_bytes, 1]], dtype=np.uint64), "DRAM")
        handle = agent.make_read(local, np.array([0], np.int32), remote, np.array([0], np.int32), b"")
        state, deadline = agent.post(handle), time.monotonic() + 20
        while state is TransferState.PROC and time.monotonic() < deadline:
            state = agent.state(handle)
        assert state is TransferState.DONE
        agent.release(handle)
        return into.copy()
    finally:
        agent.close()


def test_a_worker_serves_the_cache_it_was_handed(supervisor, cache):
    up = supervisor.start()
    assert up.generation == 1 and up.pid != os.getpid() and up.start_s > 0
    assert np.array_equal(read_cache(up.metadata, up.addresses[0], CACHE_BYTES), cache[1])
    cache[1][:4096] = 0xAB  # the engine writes its memory: the worker maps the same pages
    assert (read_cache(up.metadata, up.addresses[0], 4096) == 0xAB).all()


def test_a_worker_holds_none_of_its_supervisors_secrets(supervisor, monkeypatch):
    secret = b"kvx-cp-secret-" + os.urandom(24).hex().encode()  # in this (the control plane's) heap
    monkeypatch.setenv("KVXFERD_TEST_TOKEN", secret.decode())  # and environment
    up = supervisor.start()
    needles = {"secret": secret}
    assert search_process_memory(os.getpid(), needles)["secret"], "the control: the secret is in the supervisor"
    needles["own name"] = agent_name_of(up.metadata).encode()
    reach = NixlReach(up.metadata)
    try:
        through_nixl, num_read = reach.search(up.pid, needles)
    finally:
        reach.close()
    assert num_read > 1 << 20 and through_nixl["secret"] == []  # the widened READs found none, and
    assert through_nixl["own name"], "would have: they found the worker's own agent name in its heap"
    assert search_process_memory(up.pid, needles)["secret"] == []
    with open(f"/proc/{up.pid}/environ", "rb") as environ:
        assert b"KVXFERD_TEST_TOKEN" not in environ.read()
    child = os.fork()  # the negative control: a forked worker would carry the secret
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        assert search_process_memory(child, needles)["secret"]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_worker_killed_through_its_metadata_is_replaced_and_serves_again(supervisor, cache):
    first = supervisor.start()
    killed_s = time.monotonic()
    assert read_state(first.metadata, 0x10000, 4096) is TransferState.ERR  # unmapped in the worker: its UCX faults
    second = supervisor.wait_up(2, RESTART_BOUND_S)
    death = supervisor.deaths[0]
    assert (death.generation, death.pid, death.returncode) == (1, first.pid, -signal.SIGSEGV)
    assert death.noticed_s - killed_s < 5.0
    assert second.pid != first.pid and second.metadata != first.metadata
    assert np.array_equal(read_cache(second.metadata, second.addresses[0], CACHE_BYTES), cache[1])


def test_notices_sent_to_a_worker_reach_the_supervisor(supervisor):
    up = supervisor.start()
    sender = NixlAgent("kvx-test-notifier")
    try:
        name = sender.add_remote(up.metadata)
        sender.notify(name, b"notice-1")
        deadline = time.monotonic() + 10
        while not supervisor.notices and time.monotonic() < deadline:
            sender.poll_notifications()
            time.sleep(0.005)
    finally:
        sender.close()
    assert supervisor.notices == [("kvx-test-notifier", b"notice-1")]


def test_a_worker_that_cannot_map_is_an_error_not_a_hang(cache):
    supervisor = WorkerSupervisor("kvx-test-big", [Region(cache[0], CACHE_BYTES * 4)])  # past the memfd's end
    with pytest.raises(UnavailableError, match="could not map"):
        supervisor.start(timeout_s=60)
    assert supervisor.current is None


def test_the_backoff_starts_free_then_doubles_to_a_cap():
    assert [backoff_s(n, free_restarts=2, base_s=0.5, max_s=3.0) for n in range(1, 8)] == [
        0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_worker_that_keeps_dying_is_started_again_after_growing_pauses(cache, caplog):
    """Never given up on (whoever can kill it must not end the engine's service that way), but a worker
    that keeps dying waits longer each time (nor may they make the daemon burn a core on starts)."""
    supervisor = WorkerSupervisor("kvx-test-dying", [Region(cache[0], CACHE_BYTES)], free_restarts=1,
                                  backoff_base_s=1.0)
    try:
        up, waited_s = supervisor.start(), []
        for generation in (2, 3, 4):
            killed_s = time.monotonic()
            os.kill(up.pid, signal.SIGKILL)
            up = supervisor.wait_up(generation, 60)
            waited_s.append(time.monotonic() - killed_s)
        assert [d.returncode for d in supervisor.deaths] == [-signal.SIGKILL] * 3 and not supervisor.failure
        # Each wait is the pause (0, then 1 s, then 2 s) plus a start (1-3 s, with the machine's load): the
        # pauses as recorded, and each wait at least its pause (without the backoff a wait is a start alone).
        assert supervisor.pauses_s == [0.0, 1.0, 2.0]
        assert all(waited >= pause for waited, pause in zip(waited_s, supervisor.pauses_s)), waited_s
        assert "3 deaths in a row; the next starts in 2.0 s" in caplog.text
    finally:
        supervisor.stop()


def test_peers_cannot_write_through_a_workers_metadata(supervisor, cache):
    """The worker maps the engine's memory read-only: a NIXL WRITE there faults the worker, not the cache.
    The control: the same WRITE into an agent of this process that registered its memory writable lands."""
    up = supervisor.start()
    before = cache[1].copy()
    writer = NixlAgent("kvx-test-writer")
    source = np.full(4096, 0x5A, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    control = NixlAgent("kvx-test-target")
    try:
        writer.register_array("source", source)
        control.register_array("target", target)
        for metadata, address in ((control.metadata(), target.ctypes.data), (up.metadata, up.addresses[0])):
            name = writer.add_remote(metadata)
            local = writer.prep_local(np.array([[source.ctypes.data, 4096, 0, 4096, 1]], dtype=np.uint64), "DRAM")
            remote = writer.prep_remote(name, np.array([[address, 4096, 0, 4096, 1]], dtype=np.uint64), "DRAM")
            handle = writer.raw.make_prepped_xfer("WRITE", local, [0], remote, [0], b"")
            try:
                state, deadline = writer.post(handle), time.monotonic() + 10
                while state is TransferState.PROC and time.monotonic() < deadline:
                    control.poll_notifications()  # the control target makes progress in this process
                    state = writer.state(handle)
            except NixlError:
                state = TransferState.ERR
            if metadata is up.metadata:
                assert state is TransferState.ERR
            else:
                assert state is TransferState.DONE and (target == 0x5A).all()
    finally:
        writer.close()
        control.close()
    assert np.array_equal(cache[1], before)
    assert supervisor.wait_up(2, RESTART_BOUND_S).generation == 2
    assert supervisor.deaths[0].returncode == -signal.SIGSEGV


def test_a_worker_that_ignores_stop_is_killed(cache):
    supervisor = WorkerSupervisor("kvx-test-frozen", [Region(cache[0], CACHE_BYTES)])
    up = supervisor.start()
    os.kill(up.pid, signal.SIGSTOP)  # reads nothing, answers nothing
    start = time.monotonic()
    supervisor.stop(timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    assert supervisor.deaths[-1].returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(up.pid, 0)


HOSTILE = """
import json, socket, sys
from kvxferd.xfer.nixl.agent import NixlAgent
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--channel-fd") + 1]))
data, _, _, _ = socket.recv_fds(sock, 1 << 20, 300)
name = json.loads(data)["name"]
agents = NixlAgent(name), NixlAgent(name + ".notices")  # a proper answer first
sock.send(json.dumps({"op": "mapped", "metadata": agents[0].metadata().hex(), "addresses": [4096],
                      "notices_metadata": agents[1].metadata().hex(), "sandbox": "none"}).encode())
sock.send(json.dumps({"op": "mapped", "metadata": "00", "addresses": [1]}).encode())  # out of protocol now
sock.recv(1)
"""


def test_a_worker_out_of_protocol_is_killed_and_replaced(cache, monkeypatch):
    """What a worker sends is untrusted: a message it may not send after ``mapped`` ends that generation."""
    import subprocess
    import sys

    from kvxferd.service.workers import supervisor as module

    monkeypatch.setattr(module, "spawn_worker", lambda fd: subprocess.Popen(
        [sys.executable, "-c", HOSTILE, "--channel-fd", str(fd)], pass_fds=(fd,)))
    supervisor = WorkerSupervisor("kvx-test-hostile", [Region(cache[0], CACHE_BYTES)])
    try:
        supervisor.start()
        deadline = time.monotonic() + 30
        while len(supervisor.deaths) < 2 and time.monotonic() < deadline:  # each generation breaks protocol
            time.sleep(0.05)
        assert [d.returncode for d in supervisor.deaths[:2]] == [-signal.SIGKILL] * 2
    finally:
        supervisor.stop()


IMPOSTOR = """
import json, socket, sys
from kvxferd.xfer.nixl.agent import NixlAgent
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--channel-fd") + 1]))
socket.recv_fds(sock, 1 << 20, 300)
agents = NixlAgent("another-engines-agent"), NixlAgent("another-engines-agent.notices")
sock.send(json.dumps({"op": "mapped", "metadata": agents[0].metadata().hex(), "addresses": [4096],
                      "notices_metadata": agents[1].metadata().hex(), "sandbox": "none"}).encode())
sock.recv(1)
"""


def test_a_worker_answering_with_another_agents_name_is_refused(cache, monkeypatch):
    """Peers refuse a second agent under a name they know: a worker may not claim one it was not given."""
    import subprocess
    import sys

    from kvxferd.service.workers import supervisor as module

    monkeypatch.setattr(module, "spawn_worker", lambda fd: subprocess.Popen(
        [sys.executable, "-c", IMPOSTOR, "--channel-fd", str(fd)], pass_fds=(fd,)))
    supervisor = WorkerSupervisor("kvx-test-impostor", [Region(cache[0], CACHE_BYTES)])
    with pytest.raises(UnavailableError, match="agents not named"):
        supervisor.start(timeout_s=30)


def test_a_command_sent_while_a_generation_starts_waits_for_its_map(cache, monkeypatch):
    """Another thread may send (a holder to load) at any time; a new generation's channel takes nothing
    before its map. Found by the soak: a load that went out first was answered "load before map", and
    the generation failed as one that cannot map (given up for good)."""
    from kvxferd.service.workers import supervisor as module

    real = module.OutputRelay
    holder = NixlAgent("kvx-test-early-holder")
    supervisor = WorkerSupervisor("kvx-test-early", [Region(cache[0], CACHE_BYTES)])
    sent = []

    def relay_and_send(stream, name):  # runs between the spawn and the map
        sent.append(supervisor.send({"op": "load", "metadata": holder.metadata().hex()}))
        return real(stream, name)

    monkeypatch.setattr(module, "OutputRelay", relay_and_send)
    try:
        up = supervisor.start(timeout_s=60)
        assert up.generation == 1 and not supervisor.failure
        assert sent == [False]  # not sent before the map (the control: sent first, the start fails)
    finally:
        supervisor.stop()
        holder.close()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_replaced_worker_serves_until_its_successor_is_up_and_a_grace_then_its_metadata_reaches_nothing(cache):
    """Issue #55 item 3, make before break: the old generation answers READs and forwards notices while
    its successor starts and for ``retire_grace_s`` after; then it is stopped (not a death), and what a
    peer was handed for it reaches nothing while the successor serves the same bytes."""
    notices = []
    # The grace covers a notice's delivery on a loaded machine (milliseconds when idle).
    supervisor = WorkerSupervisor("kvx-test-replace", [Region(cache[0], CACHE_BYTES)], retire_grace_s=GRACE_S,
                                  min_replace_interval_s=0.0,
                                  on_notices=lambda generation, pairs: notices.extend((generation, p) for p in pairs))
    try:
        first = supervisor.start()
        assert reaches(first.metadata, first.addresses[0])  # the control: before, it reaches
        supervisor.replace("test: trust ended")
        second = supervisor.wait_up(2, RESTART_BOUND_S)
        assert second.pid != first.pid and agent_name_of(second.metadata) != agent_name_of(first.metadata)
        assert supervisor.replaced == [] and os.path.exists(f"/proc/{first.pid}")  # the grace: it serves on
        sender = NixlAgent("kvx-test-late-reader")
        try:
            sender.notify(sender.add_remote(first.metadata), b"late")

            def arrived() -> bool:
                sender.poll_notifications()  # progress for the notice on its way
                return (1, ("kvx-test-late-reader", b"late")) in notices

            assert wait_for(arrived, 10.0), notices
        finally:
            sender.close()
        assert wait_for(lambda: supervisor.replaced, GRACE_S + 15.0)
        (replaced,) = supervisor.replaced
        assert (replaced.generation, replaced.pid, replaced.reasons) == (1, first.pid, ("test: trust ended",))
        assert supervisor.deaths == [] and supervisor.current.generation == 2
        assert not reaches(first.metadata, first.addresses[0])
        assert np.array_equal(read_cache(second.metadata, second.addresses[0], CACHE_BYTES), cache[1])
    finally:
        supervisor.stop()
    assert not os.path.exists(f"/proc/{second.pid}")


def test_replacements_asked_for_meanwhile_are_folded_into_the_next_one_an_interval_later(cache):
    supervisor = WorkerSupervisor("kvx-test-fold", [Region(cache[0], CACHE_BYTES)], retire_grace_s=0.2,
                                  min_replace_interval_s=4.0)
    try:
        supervisor.start()
        first_asked_s = time.monotonic()
        supervisor.replace("a")
        supervisor.wait_up(2, RESTART_BOUND_S)
        supervisor.replace("b")
        supervisor.replace("c")
        supervisor.replace("b")
        assert supervisor.current.generation == 2  # not at once: the interval since "a" started
        third = supervisor.wait_up(3, RESTART_BOUND_S)
        assert time.monotonic() - first_asked_s >= 4.0
        assert wait_for(lambda: len(supervisor.replaced) == 2, 15.0)
        assert [r.reasons for r in supervisor.replaced] == [("a",), ("b", "c")]
        time.sleep(1.0)
        assert supervisor.current is third and supervisor.deaths == []  # nothing more was asked for
    finally:
        supervisor.stop()


def test_a_replaced_worker_that_dies_before_its_stop_is_a_death(cache):
    supervisor = WorkerSupervisor("kvx-test-retire-death", [Region(cache[0], CACHE_BYTES)], retire_grace_s=30.0,
                                  min_replace_interval_s=0.0)
    try:
        first = supervisor.start()
        supervisor.replace("a")
        os.kill(first.pid, signal.SIGKILL)
        supervisor.wait_up(2, RESTART_BOUND_S)
        assert wait_for(lambda: supervisor.deaths, 10.0)
        assert [(d.generation, d.returncode) for d in supervisor.deaths] == [(1, -signal.SIGKILL)]
        assert supervisor.replaced == [] and supervisor.current.generation == 2
    finally:
        supervisor.stop()
