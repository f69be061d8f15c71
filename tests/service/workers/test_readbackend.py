"""The reader worker behind :class:`WorkerReadBackend`, without a daemon: a real worker process, real NIXL
(a holder agent in this process), the decode cache in shared memory the worker maps read-write."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvxferd.client.shm import SharedArena
from kvxferd.plan.notifications import ReadNotice
from kvxferd.rig.verify.buffers import SENTINEL, allocate_engine, verify_decode
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.service.workers.readbackend import WorkerReadBackend
from kvxferd.xfer.admission import admit
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import NixlAgent

PREFILL_GROUPS, DECODE_GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture
def rig():
    """A tagged prefill rank (this process's agent), a decode rank in shared memory, a backend reading it."""
    prefill = allocate_engine("rb-p", PREFILL_GROUPS, 1, 0, tagged=True)
    holder = NixlAgent(f"rb-holder-{os.getpid()}")
    holder.register(prefill.cache)
    notices = NixlAgent(f"rb-notices-{os.getpid()}")  # stands in for the holder worker's notice agent
    num_bytes = allocate_engine("rb-d", DECODE_GROUPS, 1, 0, tagged=False).arena.nbytes
    arena = SharedArena(num_bytes)
    decode = allocate_engine("rb-d", DECODE_GROUPS, 1, 0, tagged=False, allocate=arena.allocate)
    fd = os.open(f"/dev/shm/{arena.name}", os.O_RDWR)
    base = arena.array.ctypes.data
    region_fds = [(fd, r.address - base, r.num_bytes) for regions in decode.cache.memory for r in regions]
    woken = threading.Event()
    backend = WorkerReadBackend("rb-d", region_fds, decode.cache, notices, poll_interval_s=1e-3, wake=woken.set)
    backend.start()
    try:
        with HolderThread([holder, notices]):
            yield prefill, holder, decode, backend, woken
    finally:
        backend.close()
        notices.close()
        holder.close()
        os.close(fd)
        arena.close()


def read(backend, request, timeout_s: float = 20.0, engine_id: str = "rb-p"):
    remote = backend.remote(engine_id)
    inflight = backend.post(admit(remote, request), notify=False)
    deadline = time.monotonic() + timeout_s
    while (result := backend.poll(inflight, notify=False)) is None:
        assert time.monotonic() < deadline, "no result"
        time.sleep(0.001)
    return inflight, result


def test_reads_land_byte_exact_and_their_notices_come_back_for_the_notice_agent(rig):
    prefill, holder, decode, backend, woken = rig
    remote = backend.connect([prefill.cache], [holder.metadata()])
    assert remote.agent_names == (holder.name,)
    request = random_request("rb-1", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(0))
    inflight, result = read(backend, request)
    assert result.ok and result.num_bytes > 0 and woken.is_set()
    assert verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
    sent = []
    backend.notices.notify = lambda agent, data: sent.append((agent, ReadNotice.decode(data)))
    backend.send_notices(inflight)
    backend.send_notices(inflight)  # once only
    assert [(a, n.request_id, n.ok) for a, n in sent] == [(holder.name, request.remote_request_id, True)]


def test_the_negative_control_a_read_the_worker_cannot_post_fails_whole(rig):
    """The worker lost the connection behind the backend's back: the read fails (REMOTE_GONE, the link goes
    stale), every block invalid, and the oracle sees the bytes that were not read (it can fail)."""
    prefill, holder, decode, backend, _ = rig
    backend.connect([prefill.cache], [holder.metadata()])
    assert backend.supervisor.send({"op": "disconnect", "engine_id": "rb-p"})
    request = random_request("rb-2", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(1))
    _, result = read(backend, request)
    assert not result.ok and result.failed_ranks == (0,) and result.failure is ReadFailure.REMOTE_GONE
    assert "refused" in result.error
    assert [sorted(ids.tolist()) for ids in result.invalid_block_ids] == \
        [sorted(set(np.asarray(ids).tolist())) for ids in request.local_block_ids]
    assert verify_decode([decode], PREFILL_GROUPS, request)[1] > 0


def test_what_a_worker_says_is_checked(rig):
    """A result naming no rank but a failure fails every rank; ranks outside the plan are ignored; notices
    for agents outside the connection are dropped."""
    prefill, holder, decode, backend, _ = rig
    remote = backend.connect([prefill.cache], [holder.metadata()])
    request = random_request("rb-3", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(2))
    backend.supervisor.send = lambda message, fds=(): True  # the worker never hears of it: this test answers
    inflight = backend.post(admit(remote, request), notify=False)
    backend._answer(1, {"op": "ended", "id": inflight.ticket, "failed_ranks": [7], "failure": "transfer",
                        "error": "x", "notices": [["someone-else", "00"], [holder.name, "00"]]})
    assert not inflight.result.ok and inflight.result.failed_ranks == (0,)
    assert inflight.result.invalid_block_ids[0].size > 0
    sent = []
    backend.notices.notify = lambda agent, data: sent.append(agent)
    backend.send_notices(inflight)
    assert sent == [holder.name]


def test_a_dead_worker_fails_every_read_and_connection_and_the_next_generation_connects(rig):
    prefill, holder, decode, backend, _ = rig
    remote = backend.connect([prefill.cache], [holder.metadata()])
    request = random_request("rb-4", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(3))
    real_send = backend.supervisor.send
    backend.supervisor.send = lambda message, fds=(): message["op"] == "post" or real_send(message)  # in flight
    inflight = backend.post(admit(remote, request), notify=False)
    backend.supervisor.send = real_send
    os.kill(backend.supervisor.current.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while inflight.result is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inflight.result is not None and not inflight.result.ok
    assert inflight.result.failure is ReadFailure.TRANSFER and "died" in inflight.result.error
    assert not backend.is_current(remote)
    backend.supervisor.wait_up(2, 30)
    backend.connect([prefill.cache], [holder.metadata()])
    _, result = read(backend, request)
    assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)


def test_a_read_that_ends_within_its_post_keeps_its_notices(monkeypatch):
    """The worker side alone: notices its executor sent inside ``post`` (a read that ended there) go with
    that read's ``ended``; leftovers of anything else (a probe's HELLO) do not."""
    import json
    import socket

    from kvxferd.plan.notifications import HELLO
    from kvxferd.wire.messages import pack_ids
    from kvxferd.worker import reads
    from kvxferd.worker.reads import NoticeCollector, ReaderRole
    from kvxferd.worker.sessionreads import SessionReads
    from kvxferd.xfer.records import ReadResult

    monkeypatch.setattr(reads, "admit", lambda remote, request: (remote, request))  # no plan: a stand-in executor

    class EndsAtOnce:
        def __init__(self, notices):
            self.notices, self.result = notices, ReadResult("r", "p", True, 8, 1, 0.0, ())

        def remote(self, engine_id):
            return object()

        def post(self, admitted, notify=True):
            self.notices.notify("holder-a", b"notice of r")
            return type("Posted", (), {"transferred_s": 0.0, "posted_s": 0.0, "num_host_copies": 0})()

        def poll(self, inflight, notify=True):
            return self.result

    role = ReaderRole.__new__(ReaderRole)
    role.notices, role.reads, role.notices_of, role.probes = NoticeCollector(), {}, {}, {}
    role.executor = EndsAtOnce(role.notices)
    role.session = SessionReads(role.executor, role.notices, lambda message, fds: None)
    role.notices.notify("holder-b", HELLO)  # a probe's: the control plane sends those
    role.notices.notify("holder-c", b"someone else's")  # a leftover: must not ride on this read
    ids, sizes = pack_ids([[1]])
    role.handle("post", {"id": 3, "engine_id": "p", "request": {
        "request_id": "r", "remote_request_id": "r", "ids": (ids + ids).hex(), "local_bytes": len(ids),
        "local_sizes": sizes, "remote_sizes": sizes, "caps": []}})
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    role.progress(ours)
    ended = json.loads(theirs.recv(1 << 16))
    assert ended["op"] == "ended" and ended["id"] == 3
    assert ended["notices"] == [["holder-a", b"notice of r".hex()]]
    ours.close()
    theirs.close()


@pytest.mark.parametrize("by_fd", [True, False], ids=["passed-fd", "shm-name"])
def test_a_same_host_holder_is_copied_by_the_reader_worker_even_when_its_engine_passed_an_fd(rig, by_fd):
    """Same-host reads from a sandboxed reader worker (issue #55 on #37): an object the holder names by
    ``/dev/shm`` name the worker opens itself; one its engine passed as an fd, and the holder's hold board
    (a memfd), lie behind ``/proc/<holder>/fd``, which the sandbox keeps the worker out of, so the daemon
    opens them (and a pidfd of the holder) and hands the worker the fds. Either way the rank is copied and
    its holds checked on the mapped board, not over NIXL, and it lands byte-exact. The controls: without
    the daemon's fds the worker cannot open the engine's object (the rank goes to NIXL, saying why) nor
    the board (its checks go to NIXL, saying why)."""
    import dataclasses
    import secrets

    from kvxferd.plan.board import BoardInfo, HoldBoard
    from kvxferd.plan.leases import HoldTable
    from kvxferd.rig.verify.buffers import shared_engine
    from kvxferd.service.workers import readbackend
    from kvxferd.xfer.boardmemory import BoardMemory
    from kvxferd.xfer.samehost.opened import OpenedObjects

    _, holder, decode, backend, _ = rig
    num_bytes = allocate_engine("rb-p", PREFILL_GROUPS, 1, 0, tagged=False).arena.nbytes
    arena = SharedArena(num_bytes)
    shared = shared_engine(allocate_engine("rb-s", PREFILL_GROUPS, 1, 0, tagged=True, allocate=arena.allocate), arena)
    fd = os.open(f"/dev/shm/{arena.name}", os.O_RDONLY)  # the holder's copy of the engine's fd
    cache = shared.cache
    if by_fd:
        cache = dataclasses.replace(cache, memory=tuple(
            tuple(dataclasses.replace(r, share=dataclasses.replace(r.share, name="", holder_pid=os.getpid(),
                                                                   holder_fd=fd)) for r in regions)
            for regions in cache.memory))
    memory, key = BoardMemory.create(64), secrets.token_bytes(32)
    holds = HoldTable(key, HoldBoard(64, memory.words))
    board = BoardInfo(memory.words.ctypes.data, 64, key, memory.share())
    holder.register(cache)
    holder.register_array("rb-board", memory.words)
    request = random_request("rb-sh", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(5))
    request = dataclasses.replace(request, remote_capabilities=(
        holds.hold(request.remote_request_id, request.remote_block_ids, 60, time.monotonic()),))
    try:
        remote = backend.connect([cache], [holder.metadata()], [board], same_host=True)
        assert remote.host_errors == {} and list(remote.host_ranks) == [0] and remote.board_errors == {}
        _, result = read(backend, request, engine_id="rb-s")
        assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
        original = readbackend.open_passed_objects
        readbackend.open_passed_objects = lambda remotes, boards: OpenedObjects()  # the daemon opens nothing
        try:
            remote = backend.connect([cache], [holder.metadata()], [board], same_host=True)
        finally:
            readbackend.open_passed_objects = original
        if by_fd:
            assert remote.host_ranks == {} and "did not open it" in remote.host_errors[0], remote.host_errors
        else:  # the engine's object by name, opened by the worker itself; the board (a memfd) not
            assert list(remote.host_ranks) == [0] and "did not open it" in remote.board_errors[0]
        decode.arena[...] = SENTINEL
        _, result = read(backend, request, engine_id="rb-s")  # over NIXL, or checked over NIXL: as exact
        assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
    finally:
        backend.disconnect("rb-s")
        holder.deregister("rb-s")
        holder.deregister("rb-board")
        os.close(fd)
        arena.close()
        memory.close()


def test_a_read_whose_abort_never_comes_is_ended_by_the_worker_past_its_deadline(rig):
    """The daemon fails a read at its deadline and sends the worker an abort; should that abort not arrive
    (the channel full), the worker ends the read itself DEADLINE_GRACE_S later (DEADLINE), so it holds
    nothing for ever. The holder here makes no progress, so the READ cannot end by itself (UCX's TCP
    lane: the sandbox keeps the worker off cross-memory attach); the control: a read sent without a
    deadline is still in flight then."""
    from kvxferd.worker.reads import DEADLINE_GRACE_S

    _, _, decode, backend, _ = rig
    still = NixlAgent(f"rb-still-{os.getpid()}")  # a holder nobody polls
    prefill = allocate_engine("rb-h", PREFILL_GROUPS, 1, 0, tagged=True)
    still.register(prefill.cache)
    try:
        remote = backend.connect([prefill.cache], [still.metadata()])
        request = random_request("rb-dl", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(6))
        without = backend.post(admit(remote, request), notify=False)
        # Its deadline and grace passed already (as for a read whose daemon's abort was lost): the worker
        # aborts it in the pass that posts it, before it polls it, however slow this machine is; the holder
        # makes no progress until below, so the READ cannot have ended before that abort.
        timed = backend.post(admit(remote, request), notify=False, deadline_in_s=-DEADLINE_GRACE_S)
        time.sleep(0.5)  # long enough for a READ that could end to end (the control)
        assert backend.poll(without, notify=False) is None  # the control: no deadline, still in flight
        assert backend.poll(timed, notify=False) is None  # aborted there, draining: its transfer cannot be stopped
        with HolderThread([still]):  # the holder answers: the drained READs end, and the worker says so
            ends_by = time.monotonic() + 20
            while (result := backend.poll(timed, notify=False)) is None and time.monotonic() < ends_by:
                time.sleep(0.01)
            assert result is not None and not result.ok and result.failure is ReadFailure.DEADLINE
            assert "the reader worker ended the read" in result.error
            while backend.poll(without, notify=False) is None and time.monotonic() < ends_by:
                time.sleep(0.01)
            assert without.result.ok
    finally:
        backend.disconnect("rb-h")
        still.deregister("rb-h")
        still.close()


def test_a_replaced_reader_worker_hands_over_make_before_break_and_its_links_handshake_again(rig):
    """Trust in the holders ended (a CA withdrawn: Registry.replace_workers): they learned the reader worker's
    UCX address, so a new worker starts. A read in flight ends on the old one; one that cannot end there
    (its holder makes no progress) fails whole when the old one is stopped after its grace; the connections
    do not carry over (the links are told to handshake again); the new worker reads byte-exact. A replaced
    generation that dies in its grace takes only its own reads: the new one's connections stay."""
    prefill, holder, decode, backend, _ = rig
    lost = []
    backend._on_lost = lambda: lost.append(1)
    backend.supervisor.retire_grace_s, backend.supervisor.min_replace_interval_s = 0.5, 0.0
    still = NixlAgent(f"rb-still-{os.getpid()}")  # a holder nobody polls: a READ of it cannot end
    stuck_engine = allocate_engine("rb-h", PREFILL_GROUPS, 1, 0, tagged=True)
    still.register(stuck_engine.cache)
    try:
        old = backend.supervisor.current
        remote = backend.connect([prefill.cache], [holder.metadata()])
        stuck_remote = backend.connect([stuck_engine.cache], [still.metadata()])
        request = random_request("rb-rp", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(7))
        inflight = backend.post(admit(remote, request), notify=False)
        stuck = backend.post(admit(stuck_remote, request), notify=False)
        backend.replace("ca_changed")
        new = backend.supervisor.wait_up(old.generation + 1, 30)
        assert new.pid != old.pid and lost == [1] and not backend.is_current(remote)
        deadline = time.monotonic() + 20
        while (inflight.result is None or stuck.result is None) and time.monotonic() < deadline:
            backend.poll(inflight, notify=False)
            time.sleep(0.01)
        assert inflight.result.ok  # ended where it was posted
        assert not stuck.result.ok and "stopped with the read in flight" in stuck.result.error
        while time.monotonic() < deadline:
            try:
                os.kill(old.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the replaced worker was not stopped after its grace")
        remote = backend.connect([prefill.cache], [holder.metadata()])  # the handshake the links were told to make
        decode.arena[...] = SENTINEL  # what the first read wrote is gone: the new worker must write it again
        _, result = read(backend, request)
        assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
        # Replaced again; the replaced one dies in its grace: only its own reads go with it.
        backend.supervisor.retire_grace_s = 30.0
        stuck_remote = backend.connect([stuck_engine.cache], [still.metadata()])
        stuck = backend.post(admit(stuck_remote, request), notify=False)
        backend.replace("ca_changed")
        newer = backend.supervisor.wait_up(new.generation + 1, 30)
        remote = backend.connect([prefill.cache], [holder.metadata()])
        os.kill(new.pid, signal.SIGKILL)
        while stuck.result is None and time.monotonic() < deadline + 20:
            time.sleep(0.01)
        assert not stuck.result.ok and "died" in stuck.result.error
        assert backend.is_current(remote) and backend.supervisor.current.pid == newer.pid and lost == [1, 1]
        decode.arena[...] = SENTINEL
        _, result = read(backend, request)
        assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
        assert [r.reasons for r in backend.supervisor.replaced] == [("ca_changed",)]  # (the second died)
    finally:
        backend.disconnect("rb-h")
        still.deregister("rb-h")
        still.close()
def test_a_read_with_more_ids_than_a_message_carries_sends_them_in_a_memfd(rig, monkeypatch):
    """Block ids beyond INLINE_BLOB_BYTES (a long context: about 65 000 ids fill a message in hex) travel in a
    sealed memfd beside the post; forced here for a small read, which lands byte-exact. The worker takes
    one memfd of at most MAX_IDS_BYTES whose size matches what the post says, nothing else."""
    from kvxferd.errors import InvalidArgumentError
    from kvxferd.service.workers import readbackend
    from kvxferd.wire import workerchannel
    from kvxferd.worker.reads import MAX_IDS_BYTES, _request

    prefill, holder, decode, backend, _ = rig
    remote = backend.connect([prefill.cache], [holder.metadata()])
    request = random_request("rb-fd", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(8))
    monkeypatch.setattr(workerchannel, "INLINE_BLOB_BYTES", 0)
    described, fds = readbackend.request_message(request)
    try:
        assert "ids_fd" in described and "ids" not in described and len(fds) == 1
        parsed = _request({"request": described}, fds)
        assert [ids.tolist() for ids in parsed.remote_block_ids] == [np.asarray(i).tolist() for i in request.remote_block_ids]
        for bad, bad_fds in (({**described, "ids_fd": 1}, fds), (described, []), (described, fds + fds),
                             ({**described, "ids_bytes": MAX_IDS_BYTES + 1}, fds),
                             ({**described, "ids_bytes": described["ids_bytes"] + 4}, fds),
                             ({**described, "local_bytes": described["ids_bytes"] + 4}, fds)):
            with pytest.raises(InvalidArgumentError):
                _request({"request": bad}, bad_fds)
    finally:
        for fd in fds:
            os.close(fd)
    _, result = read(backend, request)
    assert result.ok and verify_decode([decode], PREFILL_GROUPS, request) == ([], 0)
    del remote


def test_a_read_with_digests_is_refused_by_a_reader_worker_not_read_unchecked(rig):
    """Issue #59: reader workers do not check digests yet, so a read that asks for the check is refused
    (nothing posted); the same read without digests goes through (the control)."""
    from kvxferd.errors import UnavailableError
    from kvxferd.plan.holddigests import HoldDigests

    prefill, holder, decode, backend, woken = rig
    backend.connect([prefill.cache], [holder.metadata()])
    request = random_request("rb-digests", PREFILL_GROUPS, DECODE_GROUPS, 64, np.random.default_rng(4))
    with pytest.raises(UnavailableError):
        read(backend, dataclasses.replace(request, remote_digests=(HoldDigests(()),)))
    assert read(backend, request)[1].ok
