"""``python -m kvxferd.worker --channel-fd N --parent-pid P``: the worker's loop.

::

    select(channel, poll interval) ──► a command: map / pace / ping / stop (docs: wire/workerchannel.py)
    every poll interval (once mapped; ──► the agent's progress
      the control plane paces it) (UCX over TCP serves a READ only
                                           while its target makes progress) and its notices,
                                           sent to the control plane as they came, unchecked
                                           here: the control plane decides what counts

A command the worker cannot carry out is answered ``error``; the worker
lives on. It dies with its parent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import mmap
import os
import select
import signal
import socket
import sys
import time

import numpy as np

from kvxferd.errors import KvxferError
from kvxferd.wire import workerchannel as channel
from kvxferd.worker import sandbox
from kvxferd.worker.reads import READER_OPS, ReaderRole, cache_of
from kvxferd.xfer.nixl.agent import NixlAgent, agent_name_of, quiet_nixl_logging
from kvxferd.xfer.nixl.ucxpaths import FLUSH_EVERY_S, flush_c_streams
from kvxferd.xfer.osutil.ucxwake import WakeSets

log = logging.getLogger("kvxferd.worker")
MAX_NAME_CHARS = 128
MIN_POLL_S, MAX_POLL_S = 1e-4, 1.0
NOTICE_PROGRESS_S, NOTICE_POLL_S = 0.05, 0.01  # after a notice: polled every 10 ms for 50 ms (as the daemon's)
_PR_SET_PDEATHSIG = 1
SOCKET_PACED_POLL_S = 0.01  # a holder whose sockets wake it polls on its timer this seldom at most
MUTED_POLL_S = 1e-3  # and this often while a set of it is muted (kvxferd.xfer.osutil.ucxwake)
READ_POLL_MIN_S, READ_POLL_MAX_S = 20e-6, 100e-6  # a reader's sleeps while its reads are in flight
MAX_COMMANDS_PER_PASS = 64  # commands taken before the agents' progress (a burst of posts does not wait)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("PR_SET_PDEATHSIG refused (errno %d): this worker may outlive its control plane",
                    ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(1)


class Worker:
    """What one worker holds: its mappings and agent, once mapped."""

    def __init__(self, sock: socket.socket, role: str = "holder") -> None:
        self.sock, self.role = sock, role
        self.agent: NixlAgent | None = None
        self.mappings: list[mmap.mmap] = []
        self.arrays: list[np.ndarray] = []  # the registered views of the mappings
        self.poll_interval_s: float | None = None  # None: nothing to poll until mapped
        self.notices: NixlAgent | None = None  # sends the engine's read notices to holders (its reader side)
        self.notices_until = 0.0  # time.monotonic() until which notices just sent are polled on fast
        self.loaded: set[str] = set()  # holders' agents the notice agent loaded
        self.reader: ReaderRole | None = None  # the engine's reads, when this worker reads (worker/reads.py)

    def map(self, message: dict, fds: list[int]) -> dict:
        """Map each file, register every region of them with a new agent; the agents' metadata."""
        if self.agent is not None or self.reader is not None:
            raise ValueError("this worker has mapped its cache already (one engine rank per worker)")
        name, regions, interval = message.get("name"), message.get("regions"), message.get("poll_interval_s")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"name: a string of 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(regions, list) or not regions or not fds:
            raise ValueError("regions: at least one, and the fds they name")
        if not isinstance(interval, (int, float)) or not MIN_POLL_S <= interval <= MAX_POLL_S:
            raise ValueError(f"poll_interval_s: between {MIN_POLL_S} and {MAX_POLL_S}")
        reader = message.get("role", "holder") == "reader"
        if message.get("role", "holder") != self.role:
            raise ValueError(f"this worker was started as a {self.role}")
        # Each file mapped whole. A holder's read-only: peers only READ a holder, and a WRITE faults here. A
        # reader's read-write (its READs land there), and its agent's metadata goes to no one.
        prot = mmap.PROT_READ | mmap.PROT_WRITE if reader else mmap.PROT_READ
        mappings = [mmap.mmap(fd, os.fstat(fd).st_size, prot=prot) for fd in fds]
        arrays = []
        for region in regions:  # each region registered, nothing around it
            index, num_bytes, offset = ((region.get("file"), region.get("num_bytes"), region.get("offset", 0))
                                        if isinstance(region, dict) else (None, None, None))
            if not all(isinstance(v, int) for v in (index, num_bytes, offset)) or not 0 <= index < len(fds) \
                    or num_bytes <= 0 or offset < 0:
                raise ValueError("a region: a file index, num_bytes > 0 and offset >= 0")
            if offset + num_bytes > len(mappings[index]):
                raise ValueError(f"a region [{offset}, {offset + num_bytes}) past the end of its "
                                 f"{len(mappings[index])}-byte file")
            arrays.append(np.frombuffer(mappings[index], dtype=np.uint8, count=num_bytes, offset=offset))
        self.mappings = mappings
        if reader:
            self.reader = ReaderRole(name, cache_of(message, arrays), self.sock)
            self.poll_interval_s, self.arrays = float(interval), arrays
            confined = sandbox.restrict()
            return {"op": "mapped", "metadata": self.reader.executor.agent.metadata().hex(),
                    "addresses": [a.ctypes.data for a in arrays], "sandbox": confined}
        agent = NixlAgent(name)
        for n, array in enumerate(arrays):
            agent.register_array(f"region-{n}", array)
        self.agent, self.poll_interval_s, self.arrays = agent, float(interval), arrays
        self.notices = NixlAgent(f"{name}.notices")
        confined = sandbox.restrict()  # for good, now that its agents and mappings exist
        return {"op": "mapped", "metadata": agent.metadata().hex(), "addresses": [a.ctypes.data for a in arrays],
                "notices_metadata": self.notices.metadata().hex(), "sandbox": confined}

    def notice_op(self, op: str, message: dict) -> dict:
        """Load or unload a holder's metadata on the notice agent, connect to it, or send it a notice."""
        if self.notices is None:
            raise ValueError(f"{op} before map")
        if op == "load":  # once per name: the control plane counts references, and may load again
            metadata = bytes.fromhex(str(message.get("metadata")))
            name = agent_name_of(metadata, "metadata")
            if name not in self.loaded:
                self.notices.add_remote(metadata, "metadata")
                self.loaded.add(name)
            return {}
        if op == "notify":  # a batch, in order; one the notice agent refuses (its holder gone) skips only it
            entries, num_bad = channel.notify_entries(message)
            refused = []
            for agent, data in entries:
                try:
                    self.notices.notify(agent, data)
                except KvxferError as err:
                    refused.append(f"{agent[:MAX_NAME_CHARS]}: {str(getattr(err, 'message', err))[:200]}")
            self.notices_until = time.monotonic() + NOTICE_PROGRESS_S  # UCX sends them on while polled
            if num_bad or refused:
                why = ([f"{num_bad} out of bounds"] if num_bad else []) + refused[:3]
                return {"op": "error", "message": f"{num_bad + len(refused)} notices not sent: " + "; ".join(why)}
            return {}
        agent = message.get("agent")
        if not isinstance(agent, str):
            raise ValueError(f"{op}: agent must be a name")
        if op == "unload":
            if agent in self.loaded:
                self.loaded.discard(agent)
                self.notices.remove_remote(agent)
        elif op == "connect":
            self.notices.connect_to(agent)
        self.notices_until = time.monotonic() + NOTICE_PROGRESS_S  # UCX sends it on while the agent is polled
        return {}

    def pace(self, message: dict) -> dict:
        """Poll this often from now on: the control plane knows when peers need this agent's progress."""
        interval = message.get("poll_interval_s")
        if not isinstance(interval, (int, float)) or not MIN_POLL_S <= interval <= MAX_POLL_S:
            raise ValueError(f"poll_interval_s: between {MIN_POLL_S} and {MAX_POLL_S}")
        if self.agent is not None:
            self.poll_interval_s = float(interval)
        return {}  # nothing to answer

    def handle(self, message: dict, fds: list[int]) -> dict | None:
        """Carry out one command; its answer (None: stop)."""
        op = message["op"]
        try:
            if op == "map":
                return self.map(message, fds)
            if op == "ping":
                return {"op": "pong"}
            if op == "pace":
                return self.pace(message)
            if self.reader is not None and op in READER_OPS:
                return self.reader.handle(op, message, fds) or {}
            if op in ("load", "unload", "connect", "notify"):
                return self.notice_op(op, message)
            if op == "stop":
                return None
            return {"op": "error", "message": f"unknown op {op[:32]!r}"}
        except (ValueError, TypeError, KeyError, OSError, KvxferError) as err:
            answer = {"op": "error", "message": str(getattr(err, "message", None) or err)[:1000]}
            if isinstance(message.get("id"), int):  # the control plane waits for this command's answer
                answer["id"] = message["id"]
            return answer
        finally:
            channel.close_all(fds)  # mapped regions keep their mapping without the fd

    def progress(self) -> None:
        """Let UCX move what peers asked of this agent; send the notices that came meanwhile."""
        if self.reader is not None:
            self.reader.progress(self.sock)
            return
        notices = [(sender, data.hex()) for sender, data in self.agent.new_messages()
                   if len(data) <= channel.MAX_NOTICE_BYTES]
        self.notices.poll_notifications()  # receives nothing: sends the notices on
        for start in range(0, len(notices), channel.MAX_NOTICES):
            channel.send(self.sock, {"op": "notices", "notices": notices[start:start + channel.MAX_NOTICES]})

    def run(self) -> int:
        spin_s, flush_at = READ_POLL_MIN_S / 2, 0.0
        sets, woken = WakeSets(), []  # a holder's agent's sockets wake it (kvxferd.xfer.osutil.ucxwake)
        while True:
            if (now := time.monotonic()) >= flush_at:  # UCX's path reports reach the daemon (ucxpaths.py)
                flush_c_streams()
                flush_at = now + FLUSH_EVERY_S
            timeout = self.poll_interval_s
            if self.reader is not None:  # reads in flight: spin (20 µs doubling to 100 µs), else wait
                spin_s = min(2 * spin_s, READ_POLL_MAX_S) if self.reader.busy else READ_POLL_MIN_S
                timeout = spin_s if self.reader.busy else self.reader.session.figures_due_in_s()
            elif timeout is not None and time.monotonic() < self.notices_until:
                timeout = min(timeout, NOTICE_POLL_S)
            wake = sets.live(self.agent.wake_fds) if self.agent is not None else []
            if wake and timeout is not None and time.monotonic() >= self.notices_until:
                timeout = max(timeout, SOCKET_PACED_POLL_S)  # a peer's READ wakes us: no fast timer needed
            if self.agent is not None and sets.any_muted(self.agent.wake_fds):  # traffic: the short timer
                timeout = MUTED_POLL_S if timeout is None else min(timeout, MUTED_POLL_S)
            timeout = FLUSH_EVERY_S if timeout is None else min(timeout, FLUSH_EVERY_S)
            session = self.reader.session.socket if self.reader is not None else None
            watched = [self.sock] if session is None or session.ending else [self.sock, session]
            watched += wake
            readable, writable, _ = select.select(watched, [session] if session is not None and session.wants_write
                                                  else [], [], timeout)
            if session is not None:
                if writable:
                    self.reader.session.on_writable()
                if session in readable:
                    self.reader.session.on_readable()
                readable = [r for r in readable if r is self.sock]
            woken = [r for r in readable if isinstance(r, int)]
            readable = [r for r in readable if r is self.sock]
            for n in range(MAX_COMMANDS_PER_PASS if readable else 0):  # what came meanwhile, then progress
                if n and not select.select([self.sock], [], [], 0)[0]:
                    break
                try:
                    message, fds = channel.receive(self.sock)
                except channel.ChannelClosed:
                    return 0  # the control plane is gone
                except KvxferError as err:
                    channel.send(self.sock, {"op": "error", "message": err.message})
                    continue
                answer = self.handle(message, fds)
                if answer is None:
                    return 0
                if answer:
                    channel.send(self.sock, answer)
            if self.agent is not None or self.reader is not None:
                self.progress()
                sets.after_round(woken)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.worker", description=__doc__)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--role", choices=("holder", "reader"), default="holder")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="kvxferd-worker %(levelname)s %(message)s")
    quiet_nixl_logging()
    try:
        return Worker(socket.socket(fileno=args.channel_fd), args.role).run()
    except channel.ChannelClosed:
        return 0
