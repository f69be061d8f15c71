"""UCX's socket sets as a wake-up (issue #58): found with the agent, they wake a sleeping holder when a
reader's READ arrives over UCX's tcp transport, and a set that fires with nothing to do is muted.

The NIXL tests run two agents in this process over UCX's tcp transport on loopback, where a READ moves
only while the owner of the memory makes progress (the control shows it does not move without).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from kvxferd.xfer.osutil import ucxwake
from kvxferd.xfer.osutil.ucxwake import STREAK_LIMIT, WakeSets, socket_sets_made_by
from kvxferd.xfer.osutil.waker import Waker


def test_sets_made_by_a_call_are_the_new_epolls_that_watch_sockets_only():
    import select as select_module

    kept = []

    def make():
        sockets = socket.socketpair()
        watching_sockets = select_module.epoll()
        watching_sockets.register(sockets[0].fileno(), select_module.EPOLLIN)
        watching_a_set = select_module.epoll()  # as UCX's event thread's set: it watches another set
        watching_a_set.register(watching_sockets.fileno(), select_module.EPOLLIN)
        empty = select_module.epoll()
        kept.extend([sockets, watching_sockets, watching_a_set, empty])
        return "made"

    older = select_module.epoll()  # before the call: never the call's
    made, fds = socket_sets_made_by(make)
    assert made == "made"
    assert fds == (kept[1].fileno(),)
    older.close()
    for thing in kept[1:]:
        thing.close()


def test_a_set_that_stays_readable_after_its_round_is_muted_and_unmuted_once_calm():
    a, b = socket.socketpair()
    sets = WakeSets()
    try:
        b.send(b"x")  # nobody reads it: readable after every round, as UCX's stuck write
        fd = a.fileno()
        for _ in range(STREAK_LIMIT - 1):
            sets.after_round([fd])
            assert sets.live([fd]) == [fd]
        sets.after_round([fd])
        assert sets.live([fd]) == [] and sets.is_muted(fd) and sets.num_mutes == 1
        assert sets.any_muted() and sets.any_muted([fd]) and not sets.any_muted([fd + 1000])
        assert not sets.any_muted(now_s=time.perf_counter() + ucxwake.MUTE_MIN_S)
        assert sets.live([fd], time.perf_counter() + ucxwake.MUTE_MIN_S) == [fd]  # for MUTE_MIN_S only
        a.recv(1)  # calm: a round after which it is not readable resets the streak
        sets.after_round([fd])
        b.send(b"y")
        for _ in range(STREAK_LIMIT - 1):
            sets.after_round([fd])
        assert not sets.is_muted(fd, time.perf_counter() + 2 * ucxwake.MUTE_MIN_S)
        sets.forget(fd)
        assert sets.live([fd]) == [fd]
    finally:
        a.close()
        b.close()


def test_mutes_double_while_a_set_keeps_firing():
    a, b = socket.socketpair()
    sets = WakeSets()
    try:
        b.send(b"x")
        fd = a.fileno()
        lengths = []
        for _ in range(8):
            for _ in range(STREAK_LIMIT):
                sets.after_round([fd])
            lengths.append(sets._mute_s[fd])
        assert lengths[:3] == [ucxwake.MUTE_MIN_S, 2 * ucxwake.MUTE_MIN_S, 4 * ucxwake.MUTE_MIN_S]
        assert max(lengths) == ucxwake.MUTE_MAX_S
    finally:
        a.close()
        b.close()


def test_wait_any_returns_the_fds_that_woke_it():
    waker = Waker()
    a, b = socket.socketpair()
    try:
        assert waker.wait_any(0.01, [a.fileno()]) == []
        b.send(b"x")
        assert waker.wait_any(1.0, [a.fileno()]) == [a.fileno()]
        a.recv(1)
        waker.set()
        assert waker.wait_any(1.0, [a.fileno()]) == []  # woken by set(): nothing of fds
        assert waker.wait_any(0.0, [a.fileno()]) == []
    finally:
        a.close()
        b.close()


# ---- over NIXL ------------------------------------------------------------------------------------------

@pytest.fixture
def tcp_agents(monkeypatch):
    """A holder agent with 1 MiB registered and a reader that knows it, over UCX's tcp transport."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from kvxferd.xfer.nixl.agent import NixlAgent

    holder, reader = NixlAgent("wake-holder"), NixlAgent("wake-reader")
    source, target = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, np.uint8)
    holder.register_array("source", source)
    reader.register_array("target", target)
    name = reader.add_remote(holder.metadata())
    yield holder, reader, name, source, target
    holder.close()
    reader.close()


def _post_read(reader, name: str, source: np.ndarray, target: np.ndarray, num_bytes: int):
    raw = reader.raw
    local = raw.get_xfer_descs([(target.ctypes.data, num_bytes, 0)], "DRAM")
    remote = raw.get_xfer_descs([(source.ctypes.data, num_bytes, 0)], "DRAM")
    handle = raw.initialize_xfer("READ", local, remote, name)
    raw.transfer(handle)
    return handle


def _ends_within(reader, handle, seconds: float) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if reader.raw.check_xfer_state(handle) != "PROC":
            return True
        time.sleep(20e-6)
    return False


def test_a_holder_asleep_on_its_sets_serves_a_read_and_without_progress_none_moves(tcp_agents):
    holder, reader, name, source, target = tcp_agents
    assert holder.wake_fds, "UCX's tcp socket sets of the holder were found"
    holder.poll_notifications()
    # The control: nobody drives the holder, and the READ does not move.
    handle = _post_read(reader, name, source, target, 256 << 10)
    assert not _ends_within(reader, handle, 0.5), "the READ needs the holder's progress (else this proves nothing)"
    # The holder asleep on its sets (and an eventfd nobody sets) with a 30 s timer: the READ wakes it.
    waker, woken, stop = Waker(), [], threading.Event()

    def serve() -> None:
        while not stop.is_set():
            fds = waker.wait_any(30.0, list(holder.wake_fds))
            woken.append(fds)
            holder.poll_notifications()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert _ends_within(reader, handle, 5.0)
        reader.raw.release_xfer_handle(handle)
        start = time.perf_counter()
        again = _post_read(reader, name, source, target, 1 << 20)
        assert _ends_within(reader, again, 5.0)
        took_s = time.perf_counter() - start
        reader.raw.release_xfer_handle(again)
        assert np.array_equal(target, source)
        assert any(fds for fds in woken), "a set, not the timer, woke the holder"
        assert took_s < 2.0, took_s  # the 30 s timer never fired: a set did
    finally:
        stop.set()
        waker.set()
        thread.join(5)


def test_a_reader_that_stops_before_its_connection_is_set_up_costs_the_holder_little(monkeypatch):
    """A reader connects, posts a READ and never makes progress again: UCX keeps the holder's side
    pending on a writable socket, so the holder's set fires again at once however often it is served
    (NIXL's own progress thread spins a core so). Muted, the holder's rounds stay few; the control, the
    same loop without muting in the same sitting, runs hot."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from kvxferd.xfer.nixl.agent import NixlAgent

    holder = NixlAgent("stuck-holder")
    source = np.ones(1 << 20, np.uint8)
    holder.register_array("source", source)
    rounds, mute, stop = [0], threading.Event(), threading.Event()

    def serve() -> None:  # as the data plane: asleep on the sets, muting those that fire for nothing
        waker, sets, woken = Waker(), WakeSets(), []
        while not stop.is_set():
            holder.poll_notifications()
            if mute.is_set():
                sets.after_round(woken)
            woken = waker.wait_any(0.05, sets.live(holder.wake_fds))
            rounds[0] += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()  # served from before the reader connects, as a daemon's holder is

    def rounds_in(seconds: float) -> int:
        first = rounds[0]
        time.sleep(seconds)
        return rounds[0] - first

    readers = []
    try:
        # The state needs the reader to stop at the right moment of its connection's set-up: on a loaded
        # machine its first post may finish it. A new reader each try, at most five; then this test says it
        # could not make the state (the mute itself is proven above on sockets, deterministically).
        for attempt in range(5):
            reader = NixlAgent(f"stuck-reader-{attempt}")
            target = np.zeros(1 << 20, np.uint8)
            reader.register_array("target", target)
            readers.append((reader, target, _post_read(reader, reader.add_remote(holder.metadata()), source,
                                                       target, 1 << 20)))  # never polled again
            hot = rounds_in(0.5)
            if hot > 500:
                break
        if hot <= 500:
            pytest.skip(f"the stuck set-up did not arise in 5 tries (the last: {hot} rounds in 0.5 s)")
        mute.set()
        time.sleep(0.1)
        muted = rounds_in(0.5)
        assert muted < 100, (muted, hot)  # every 50 ms at most, past the first mutes (MUTE_MAX_S)
    finally:
        stop.set()
        thread.join(5)
        holder.close()
        for reader, _, _ in readers:
            reader.close()


def test_a_set_whose_sockets_move_bytes_is_a_stream_and_one_whose_do_not_is_muted():
    """Through an epoll set, as UCX keeps them: a socket with bytes arriving unread (a bulk WRITE into
    our memory) keeps its set live however often it stays readable; a socket that is only writable, with
    nothing in flight (UCX waiting on a stopped peer), gets its set muted."""
    import select as select_module

    a, b = socket.socketpair()
    streaming, stuck = select_module.epoll(), select_module.epoll()
    sets = WakeSets()
    try:
        streaming.register(a.fileno(), select_module.EPOLLIN)
        b.send(b"x" * 1000)
        for _ in range(3 * STREAK_LIMIT):
            sets.after_round([streaming.fileno()])
        assert not sets.is_muted(streaming.fileno()), "bytes arrive: a stream"
        a.recv(1000)
        stuck.register(a.fileno(), select_module.EPOLLOUT)  # writable, nothing sent or unread
        for _ in range(STREAK_LIMIT):
            sets.after_round([stuck.fileno()])
        assert sets.is_muted(stuck.fileno()), "readable round after round with no byte moving: muted"
    finally:
        streaming.close()
        stuck.close()
        a.close()
        b.close()
