"""NIXL's own progress thread, measured: what it would give the daemon and what it costs.

kvxferd runs its agents without NIXL's progress thread and polls them from
the daemon's data-plane thread. Issue #12 asked for the thread with a
non-zero delay to be measured before choosing. NIXL's Python wrapper always
sets ``pthrDelay = 0`` (a thread that spins a core), so the delay is set here
through the bindings' config class, the only way in from Python. In NIXL
1.5.1 the thread sleeps in ``poll()`` on the UCX worker's event fd with a
timeout of the delay (at least 1 ms) and wakes when UCX has work.

Three measurements, each one agent against one peer in this process:

* idle CPU of an agent that has the thread: alone; with a peer added whose
  own agent has not made progress since (its connection set-up pending);
  after some traffic;
* a READ from an owner whose Python never polls its agent: without the
  thread the transfer does not complete; with it, it does;
* a notification's one-way trip to a receiver whose Python checks
  ``get_new_notifs`` right after the send and then every 100 µs (as the
  daemon's holder polls), with and without the thread.

And one about the owner's progress without the thread (what a holder that
polls rarely would cost its readers): READs of 256 KiB from a connected owner
that does not poll during the read, alone, carrying a notification, right
after the reader's agent sent the owner a notification, and right after a
third agent did. A READ behind a notification on the same pair of agents
waits until the owner makes progress; one behind another agent's does not.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from kvxferd.rig.bench.common import percentiles_us, process_cpu_s
from kvxferd.xfer.nixl.agent import quiet_nixl_logging
from kvxferd.xfer.nixl.nixl_module import nixl_api

DELAY_US = 1000  # the thread's poll() timeout; NIXL rounds it up to whole milliseconds


@contextmanager
def _progress_delay(delay_us: int):
    """Agents made inside get NIXL's progress thread with ``delay_us`` (the wrapper would force 0)."""
    api, bindings = nixl_api()
    base = bindings.nixlAgentConfig

    class DelayedConfig(base):  # the wrapper assigns pthrDelay = 0 after construction: keep ours instead
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):
            base.pthrDelay.__set__(self, delay_us)

    api.nixlBind.nixlAgentConfig = DelayedConfig
    try:
        yield
    finally:
        api.nixlBind.nixlAgentConfig = base


def make_agent(name: str, *, progress_thread: bool):
    """A raw ``nixl_agent`` over UCX, with or without NIXL's progress thread (``DELAY_US``)."""
    api, _ = nixl_api()
    quiet_nixl_logging()
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=["UCX"],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    if not progress_thread:
        return api.nixl_agent(name, config)
    with _progress_delay(DELAY_US):
        return api.nixl_agent(name, config)


def _core_percent(seconds: float) -> float:
    cpu_s = process_cpu_s()
    time.sleep(seconds)
    return (process_cpu_s() - cpu_s) / seconds * 100


def _connect(a, b) -> None:
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())


def _traffic(sender, receiver, num_messages: int = 20) -> None:
    for n in range(num_messages):
        sender.send_notif(receiver.name, b"t%d" % n)
        time.sleep(0.002)
        sender.get_new_notifs()
        receiver.get_new_notifs()


def idle_cpu(seconds: float = 1.0) -> dict:
    """% of a core used by this process while an agent with the thread sits idle, in three states."""
    receiver = make_agent("progress-idle-r", progress_thread=True)
    sender = make_agent("progress-idle-s", progress_thread=False)
    figures = {"alone": _core_percent(seconds)}
    _connect(sender, receiver)
    figures["peer_added_silent"] = _core_percent(seconds)
    _traffic(sender, receiver)
    figures["after_traffic"] = _core_percent(seconds)
    return figures


def _buffers(owner, reader, num_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The owner's source and the reader's target, registered (keep them alive while in use)."""
    source, target = np.ones(num_bytes, np.uint8), np.zeros(num_bytes, np.uint8)
    owner.register_memory([(source.ctypes.data, source.nbytes, 0, "")], "DRAM")
    reader.register_memory([(target.ctypes.data, target.nbytes, 0, "")], "DRAM")
    return source, target


def _transfer_within(agent, handle, timeout_s: float) -> tuple[str, float | None]:
    """Post ``handle`` and check it until it leaves PROC or ``timeout_s``: its state, and the
    seconds it took when DONE (else None)."""
    start = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC" and time.perf_counter() - start < timeout_s:
        state = agent.check_xfer_state(handle)
    return state, (time.perf_counter() - start if state == "DONE" else None)


def _completed(times_s: list[float | None]) -> dict:
    """How many of the tries completed (a time, not None), and their median µs."""
    done_s = [t for t in times_s if t is not None]
    return {"completed": len(done_s), "tried": len(times_s),
            "median_us": float(np.median(done_s) * 1e6) if done_s else None}


def read_from_idle_owner(progress_thread: bool, repeat: int = 3, timeout_s: float = 0.5) -> dict:
    """READs of 1 MiB from an owner whose Python never touches its agent; completed count and time."""
    tag = "t" if progress_thread else "n"
    owner, reader = make_agent(f"progress-owner-{tag}", progress_thread=progress_thread), \
        make_agent(f"progress-reader-{tag}", progress_thread=False)
    source, target = _buffers(owner, reader, 1 << 20)
    reader.add_remote_agent(owner.get_agent_metadata())
    remote = reader.get_xfer_descs([(source.ctypes.data, source.nbytes, 0)], "DRAM")
    local = reader.get_xfer_descs([(target.ctypes.data, target.nbytes, 0)], "DRAM")
    times_s = []
    for n in range(repeat):
        handle = reader.initialize_xfer("READ", local, remote, owner.name, b"r%d" % n)
        times_s.append(_transfer_within(reader, handle, timeout_s)[1])
        reader.release_xfer_handle(handle)
    return _completed(times_s)


def notification_trip(progress_thread: bool, repeat: int = 300, poll_s: float = 100e-6) -> dict:
    """One-way trips to a receiver that polls every ``poll_s`` in Python (p50/p99 µs)."""
    tag = "t" if progress_thread else "n"
    receiver = make_agent(f"progress-trip-r-{tag}", progress_thread=progress_thread)
    sender = make_agent(f"progress-trip-s-{tag}", progress_thread=False)
    _connect(sender, receiver)
    _traffic(sender, receiver)
    trips = []
    for n in range(repeat):
        start = time.perf_counter()
        sender.send_notif(receiver.name, b"n%d" % n)
        while True:
            sender.get_new_notifs()  # the sender must make progress too
            if receiver.get_new_notifs():
                break
            time.sleep(poll_s)
        trips.append(time.perf_counter() - start)
    return percentiles_us(trips[10:])


def reads_behind_notifications(repeat: int = 30, timeout_s: float = 0.02) -> dict:
    """READs of 256 KiB from an owner that does not poll while they run: completed within
    ``timeout_s`` and their median µs, for four cases (after each, the owner polls once); and a
    hold board's check, two READs of 64 bytes, alone."""
    owner, reader, other = (make_agent(f"owner-progress-{n}", progress_thread=False) for n in ("o", "r", "n"))
    source, target = _buffers(owner, reader, 1 << 18)
    for sender in (reader, other):
        _connect(sender, owner)
        _traffic(sender, owner)
    remote = reader.prep_xfer_dlist(owner.name, [(source.ctypes.data, source.nbytes, 0)], "DRAM")
    local = reader.prep_xfer_dlist("", [(target.ctypes.data, target.nbytes, 0)], "DRAM")
    buckets = [(source.ctypes.data + offset, 64, 0) for offset in (0, 4096)]  # two buckets of a board
    board = (reader.prep_xfer_dlist("", [(target.ctypes.data + o, 64, 0) for o in (0, 64)], "DRAM"),
             reader.prep_xfer_dlist(owner.name, buckets, "DRAM"), [0, 1])

    def read(notification: bytes = b"", notifier=None, lists=(local, remote, [0])) -> float | None:
        if notifier is not None:
            notifier.send_notif(owner.name, b"before")
        local_list, remote_list, ids = lists
        handle = reader.make_prepped_xfer("READ", local_list, ids, remote_list, ids, notification)
        state, took_s = _transfer_within(reader, handle, timeout_s)
        owner.get_new_notifs()  # the owner's progress lets a waiting READ finish
        while state == "PROC":
            state = reader.check_xfer_state(handle)
        reader.release_xfer_handle(handle)
        for agent in (reader, other):
            agent.get_new_notifs()
        return took_s

    cases = {"alone": {}, "notification attached": {"notification": b"n"},
             "after the reader's notification": {"notifier": reader},
             "after another agent's notification": {"notifier": other},
             "a board check (2 x 64 B), alone": {"lists": board}}
    for _ in range(5):  # warm-up: the first READs of a new pair may wait for the owner (connection set-up)
        read()
    return {label: _completed([read(**kwargs) for _ in range(repeat)]) for label, kwargs in cases.items()}


def run(seconds: float = 1.0, repeat: int = 300) -> dict:
    return {"delay_us": DELAY_US, "idle_core_percent": idle_cpu(seconds),
            "idle_owner_read": {"without": read_from_idle_owner(False), "with": read_from_idle_owner(True)},
            "trip_polling_100us": {"without": notification_trip(False, repeat), "with": notification_trip(True, repeat)},
            "reads_behind_notifications": reads_behind_notifications()}


def format_lines(f: dict) -> list[str]:
    idle, reads, trips = f["idle_core_percent"], f["idle_owner_read"], f["trip_polling_100us"]

    def read_text(row: dict) -> str:
        done = f"{row['completed']}/{row['tried']} completed"
        return done + (f", median {row['median_us']:.0f} us" if row["median_us"] is not None else ", the rest stalled")

    return [f"NIXL progress thread (poll timeout {f['delay_us'] / 1000:g} ms), one agent idle, % of a core: "
            f"alone {idle['alone']:.1f}, peer added but silent {idle['peer_added_silent']:.1f}, "
            f"after traffic {idle['after_traffic']:.1f}",
            f"READ 1 MiB from an owner that never polls: without the thread {read_text(reads['without'])}; "
            f"with it {read_text(reads['with'])}",
            f"notification one way, receiver checking at once, then every 100 us: p50 {trips['without']['p50_us']:.0f} us "
            f"without the thread, {trips['with']['p50_us']:.0f} us with it",
            "READ 256 KiB from a connected owner that does not poll during it (no thread), done within 20 ms:",
            *(f"  {label:<38}{read_text(row)}" for label, row in f["reads_behind_notifications"].items())]
