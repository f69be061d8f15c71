"""Execute planned reads with NIXL into one local engine rank's cache.

::

    connect(remote ranks' caches, metadata, boards)   once per remote engine (connections.py)
    post(admitted read)                               admission.py planned and sealed it; on a
                                                      replaced connection it is admitted again
      one RankTransfer per remote rank                rankstate.py: ADMITTING -> CHECKING ->
                                                      MOVING -> RECHECKING -> DONE / FAILED
    poll / abort                                      rankmachine.py advances every rank; the
                                                      mover (movers.py) moves its data
      all ended -> ReadResult (status, bytes, invalid block ids per group; stale ranks failed)
    send_notices                                      once, after the result
      a notice from the notice agent to every holder (poll sends it at once unless
      told not to: a daemon hands the result to its engine first)

Notices come from a second agent because a READ queued behind a notification
on the same pair of agents waits for the holder's next poll (measured in
``kvxferd bench floors``); nothing answers them. A failure of one rank fails
that request only: its result lists the local block ids the failed ranks
were writing, and other requests carry on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from kvxferd.errors import KvxferError, UnavailableError
from kvxferd.plan.board import BoardInfo, hold_tag
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import ReadNotice
from kvxferd.xfer.admission import admit
from kvxferd.xfer.connections import Connections
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.movers import ReadMover
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.nixl.checks import BoardProbe, CheckArea
from kvxferd.xfer.rankmachine import RankMachine
from kvxferd.xfer.rankstate import RankTransfer
from kvxferd.xfer.records import AdmittedRead, InFlightRead, ReadResult, ReadTimes, RemoteEngine
from kvxferd.xfer.samehost.opened import OpenedObjects
from kvxferd.xfer.samehost.ranks import drop_all
from kvxferd.xfer.verify import DigestCounts, corrupt_blocks, host_memories

ABORT_DRAIN_S = 30.0  # how long an aborted read's result waits for transfers UCX cannot stop (abort)
UNSETTLED_ERROR = ("an aborted transfer was still in flight after abort_drain_s: its bytes may still land in "
                   "the named blocks; do not reuse them for another request yet")


class ReadExecutor:
    """Reads into one local engine rank's registered cache (a :class:`kvxferd.xfer.backend.ReadBackend`).

    Owns a second agent, ``notices``, that sends the readers' notices (see
    the module doc), and the area its board checks land in.

    Two threads may use one executor: a daemon posts small reads on its event
    loop and polls the rest on its data-plane thread. ``lock`` lets one
    thread at a time in: every public call takes it, so the check area, the
    connections and the prepared lists need no lock of their own.
    Re-entrant: a caller that holds it across several calls (the loop's
    post-and-poll) keeps it.
    """

    wakes_when_done = False  # poll() advances its reads

    def __init__(self, agent: NixlAgent, cache: EngineCache, notices: NixlAgent | None = None) -> None:
        """``notices``: the agent the notices go out from (anything with a NixlAgent's add_remote, remove_remote,
        connect_to, notify, poll_notifications, metadata and close: a data-plane worker's, docs/dataplane.md);
        by default a second agent of this process."""
        self.agent = agent
        self.cache = cache
        self.lock = threading.RLock()
        agent.register(cache)
        self.checks = CheckArea(agent)
        self.notices = notices if notices is not None else NixlAgent(f"{agent.name}.notices")
        self.connections = Connections(agent, self.notices, cache, self.checks)
        self.mover = ReadMover(agent, lambda: self.connections.current.values())
        self.machine = RankMachine(self.checks, self.mover)
        self.num_notices_sent = 0  # the data plane polls the notice agent (its progress) only after new ones
        self.abort_drain_s = ABORT_DRAIN_S
        self.digests = DigestCounts()  # reads checked against their holders' digests (issue #59)
        self._memories = host_memories(cache)  # views only: touched when a read brings digests

    @property
    def num_host_copies(self) -> int:
        """Rank reads copied same-host instead of read over NIXL."""
        return self.mover.num_host_copies

    # ---- connections ---------------------------------------------------------
    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo] | None = None, *, same_host: bool = False,
                opened: OpenedObjects | None = None) -> RemoteEngine:
        """Plan and prepare reads from a remote engine (one cache, metadata and hold board per rank).

        Without ``boards`` nothing is checked: reads of memory nobody holds
        (benchmarks of the data path alone). The daemon always passes them, and
        then every read must carry each rank's capability for exactly its
        remote blocks (:mod:`kvxferd.plan.capability`), checked before it is posted.

        ``same_host``: the remote ranks proved they share this host; each whose
        cache names its memory (shared-memory objects, CUDA IPC handles) is
        opened here and read by copying (:mod:`kvxferd.xfer.samehost`), the others over NIXL. ``opened``:
        objects passed by fd that another process opened for this one (a reader worker's daemon).
        """
        with self.lock:
            return self.connections.connect(remotes, metadata, boards, same_host, opened)

    def disconnect(self, engine_id: str) -> None:
        """Forget a remote engine: release its lists and its agents (once no aborted read of it still has a
        transfer running: until then it is retired, not released)."""
        with self.lock:
            self.connections.disconnect(engine_id)

    def remote(self, engine_id: str) -> RemoteEngine:
        """The current connection to a remote engine; :class:`NotFoundError` when there is none."""
        return self.connections.remote(engine_id)

    def is_current(self, remote: RemoteEngine) -> bool:
        """False once ``remote`` was disconnected or replaced by a new handshake."""
        return self.connections.is_current(remote)

    def start_probe(self, remote: RemoteEngine) -> BoardProbe:
        """Post one READ of every remote rank's hold board (:class:`BoardProbe`), and send each holder the
        notice agent's ``HELLO``: a new connection's first transfer and first notification cost
        milliseconds here, not in a request. See :meth:`poll_probe`."""
        with self.lock:
            if remote.probe is None:
                self.num_notices_sent += 1  # the data plane makes progress for the notice agent
            return self.connections.start_probe(remote)

    def poll_probe(self, remote: RemoteEngine) -> dict[int, str] | None:
        """None while the probe runs; then the error of each remote rank whose board did not answer.
        Raises :class:`TransferError` when the connection was released or replaced meanwhile."""
        with self.lock:
            return self.connections.poll_probe(remote)

    def abort_probe(self, remote: RemoteEngine, reason: str) -> None:
        with self.lock:
            self.connections.abort_probe(remote, reason)

    def release_host_memory(self, remote: RemoteEngine, reason: str) -> None:
        """Unmap a remote engine's same-host memory (its holder changed or went away): its ranks read over
        NIXL until a new connection maps them again, and a dead holder's cache is not kept alive here."""
        with self.lock:
            drop_all(remote, reason)

    def close(self) -> None:
        """Disconnect every remote engine, deregister the local cache, destroy the agents."""
        with self.lock:
            self.connections.close()
            self.checks.close()
            self.agent.deregister(self.cache.engine_id)
            self.agent.close()
            self.notices.close()

    # ---- reads ---------------------------------------------------------------
    def post(self, admitted: AdmittedRead, start_s: float | None = None, *, notify: bool = True,
             deadline_in_s: float | None = None) -> InFlightRead:
        """Post a read admitted on a connection to its remote engine; a read admitted before a
        re-handshake (or not planned yet) is admitted on the current one. Typed errors, nothing
        posted, when it is refused or the remote engine is gone. ``notify``: as in :meth:`poll` (the
        post polls once). The posted read's ``admitted`` says on which connection it runs. Its deadline
        is the caller's to enforce (``deadline_in_s`` is not needed here: :meth:`abort` runs in this process)."""
        if admitted.request.remote_digests and self._memories is None:  # refused, not read unchecked
            raise UnavailableError("remote_digests", f"no digest checks of {self.cache.mem_type} memory yet")
        with self.lock:
            current = self.connections.remote(admitted.remote.plan.remote_engine_id)
            if current is not admitted.remote or admitted.planned is None:
                admitted = admit(current, admitted.request, admitted)
            planned, capabilities = admitted.planned, admitted.request.remote_capabilities
            checked = bool(current.board_lists)  # each rank's data waits for its board to show the hold
            ranks = {r.remote_rank: RankTransfer(r, hold_tag(capabilities[r.remote_rank]) if checked else 0)
                     for r in planned.reads}
            inflight = InFlightRead(admitted, ranks, ReadTimes(time.perf_counter() if start_s is None else start_s))
            self.machine.start(inflight)
            self._poll(inflight, notify)
            return inflight

    def poll(self, inflight: InFlightRead, *, notify: bool = True) -> ReadResult | None:
        """Advance a posted request; returns its result once every rank's read and board check ended.

        With ``notify`` the holders' notices go out with the result; without, the
        caller sends them with :meth:`send_notices` once it has passed the result on
        (the holders' bookkeeping need not delay the engine: the checks already ran).
        """
        with self.lock:
            return self._poll(inflight, notify)

    def _poll(self, inflight: InFlightRead, notify: bool) -> ReadResult | None:
        if inflight.result is None:
            if inflight.drain is not None:
                if not self._settle(inflight):
                    return None  # aborted: its transfers may still write (abort)
            elif not self.machine.advance(inflight):
                return None
            inflight.result = self._finish(inflight)
        if notify:
            self._send_notices(inflight)
        return inflight.result

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure = ReadFailure.ABORTED, *,
              drain: bool = True) -> ReadResult | None:
        """Fail every rank still reading or checking, and finish.

        UCX cannot stop a READ in flight: released, it still writes its
        bytes when they arrive (over TCP, seconds later, once a broken link
        is back). So with ``drain`` the result waits until every such
        transfer ended, up to ``abort_drain_s`` (past that it says its blocks
        may still be written): None until then, :meth:`poll` it. Without
        ``drain`` everything is released at once (the memory is about to go).
        """
        with self.lock:
            if inflight.result is not None:
                return self._poll(inflight, notify=True)
            self.machine.abort(inflight, reason, failure, self.abort_drain_s if drain else 0.0)
            if not drain:
                self._settle(inflight, force=True)
            return self._poll(inflight, notify=True)

    def _settle(self, inflight: InFlightRead, force: bool = False) -> bool:
        """Release what drained; a connection replaced meanwhile is released once its last read drained."""
        settled = self.machine.settle(inflight, force=force)
        drain = inflight.drain
        if settled and drain.counted:
            drain.counted = False
            self.connections.drained(inflight.remote)
        elif not settled and not drain.counted:
            drain.counted = True
            inflight.remote.num_draining += 1
        return settled

    def _finish(self, inflight: InFlightRead) -> ReadResult:
        planned, remote, errors = inflight.planned, inflight.remote, inflight.errors
        if not inflight.times.transferred_s:  # aborted: its transfers ended (or were given up) by now
            inflight.times.transferred_s = time.perf_counter()
        unsettled = inflight.drain is not None and inflight.drain.unsettled
        corrupt = None if errors or unsettled else corrupt_blocks(planned, self.cache, self._memories, self.digests)
        if corrupt is not None:  # every byte arrived under a live hold, and some differ from what was held
            errors, invalid = corrupt
            failed = tuple(sorted(errors))
            error = "; ".join(f"rank {q}: digest check: {errors[q]}" for q in failed)
            return ReadResult(planned.request.request_id, remote.plan.remote_engine_id, False, 0,
                              sum(r.num_descriptors for r in planned.reads), time.perf_counter() - inflight.times.start_s,
                              invalid, failed, error, ReadFailure.CORRUPT, False)
        failed = tuple(sorted(errors))
        invalid = planned.invalid_block_ids(failed) if failed else tuple(np.zeros(0, np.int64) for _ in planned.units)
        error = "; ".join([f"rank {q}: {errors[q]}" for q in failed] + ([UNSETTLED_ERROR] if unsettled else []))
        return ReadResult(planned.request.request_id, remote.plan.remote_engine_id, not errors,
                          sum(r.num_bytes for r in planned.reads if r.remote_rank not in errors),
                          sum(r.num_descriptors for r in planned.reads), time.perf_counter() - inflight.times.start_s,
                          invalid, failed, error or None, inflight.failure, unsettled)

    # ---- notices -------------------------------------------------------------
    def send_notices(self, inflight: InFlightRead) -> None:
        """Tell every holder how a finished read went, once (nothing before its result).

        Not a rank whose hold had ended: that notice could only count for a
        later hold of the same request id. A holder that is gone is skipped:
        its hold expires on its side.
        """
        with self.lock:
            self._send_notices(inflight)

    def _send_notices(self, inflight: InFlightRead) -> None:
        result = inflight.result
        if result is None or inflight.notified:
            return
        inflight.notified = True
        planned, remote = inflight.planned, inflight.remote
        capabilities = planned.request.remote_capabilities
        for q in planned.notify_ranks:
            rank = inflight.ranks.get(q)
            if rank is not None and rank.failure is ReadFailure.STALE:
                continue
            notice = ReadNotice(planned.request.remote_request_id, self.cache.engine_id, self.cache.tp_rank,
                                remote.plan.expected_notifiers[q], result.ok, alone=rank is None or not rank.waited,
                                capability=capabilities[q] if q < len(capabilities) else ReadNotice.capability)
            try:
                self.notices.notify(remote.agent_names[q], notice.encode())
            except KvxferError:  # the peer went away, or this executor was closed meanwhile
                pass
        self.num_notices_sent += 1
        try:
            self.notices.poll_notifications()  # progress: sends them on now (the daemon's thread also polls it)
        except KvxferError:
            pass

    def progress_notices(self) -> None:
        """Make progress for the notice agent: UCX sends a notice on only while its agent is polled."""
        with self.lock:
            self.notices.poll_notifications()

    def notify_holder(self, agent_name: str, message: bytes) -> None:
        """Send one record to a holder's agent from the notice agent (a push's expectation, issue #57)."""
        with self.lock:
            self.notices.notify(agent_name, message)
            self.num_notices_sent += 1  # the data plane makes progress for the notice agent
            self.notices.poll_notifications()

    def notices_metadata(self) -> bytes:
        """The notice agent's metadata: how this rank introduces itself to holders as a reader."""
        with self.lock:
            return self.notices.metadata()
