"""Execute planned reads with NIXL: connect once, then one transfer per remote rank.

::

    connect(remote ranks' caches + agent metadata + boards)   once per remote engine
      plan = EngineTransferPlan(local, remotes)               pure, validated
      add_remote_agent x T_r (reader and notice agent); prep_xfer_dlist x 3 per read
      rank (strided rows: local, remote, the holder's board)
    post(request)                                              per request
      plan.plan_request -> ids per rank                       typed errors before any I/O
      capabilities checked; READ each rank's two board        the hold is alive before a byte
        buckets (checks.py)                                     of its blocks moves
    poll / wait                                                no busy spin
      a rank's board has its hold's tag -> make_prepped_xfer   no notification attached
        (ids) + transfer; no tag -> stale, nothing copied
      a rank's data ended -> READ its board buckets again      still held after the copy?
      all ended -> release handles, ReadResult (status, bytes, invalid block ids per
      group; stale ranks failed)
    send_notices                                               once, after the result
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

from kvxferd.cuda.copies import BatchRefused
from kvxferd.errors import InvalidArgumentError, KvxferError, NotFoundError, TransferError
from kvxferd.plan.board import BoardInfo, hold_tag
from kvxferd.plan.capability import HOLD_KEY_BYTES, check_read_capabilities
from kvxferd.plan.engine import EngineTransferPlan, PlannedRead, RankRead, ReadRequest
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import HELLO, ReadNotice
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState
from kvxferd.xfer.nixl.checks import BoardProbe, CheckArea, board_rows
from kvxferd.xfer.nixl.transfers import NixlTransfer, nixl_failure
from kvxferd.xfer.samehost.hostmaps import HostRank
from kvxferd.xfer.records import InFlightRead, ReadFailure, ReadResult, RemoteEngine, TransferFailure
from kvxferd.xfer.samehost.ranks import SameHostOpener, drop_all, drop_rank

POLL_MIN_S = 20e-6  # first sleep between state checks; doubles up to POLL_MAX_S
POLL_MAX_S = 1e-3
ABORT_DRAIN_S = 30.0  # how long an aborted read's result waits for transfers UCX cannot stop (abort)
UNSETTLED_ERROR = ("an aborted transfer was still in flight after abort_drain_s: its bytes may still land in "
                   "the named blocks; do not reuse them for another request yet")


class ReadExecutor:
    """Reads into one local engine rank's registered cache.

    Owns a second agent, ``notices``, that sends the readers' notices (see
    the module doc), and the area its board checks land in.

    Two threads may use one executor: a daemon posts small reads on its event
    loop and polls the rest on its data-plane thread. ``lock`` lets one
    thread at a time in: every public call takes it (posts, polls, aborts,
    notices, probes, connect, disconnect, close), so the check area and the
    prepared lists need no lock of their own. Re-entrant: a caller that holds
    it across several calls (the loop's post-and-poll) keeps it.
    """

    def __init__(self, agent: NixlAgent, cache: EngineCache) -> None:
        self.agent = agent
        self.cache = cache
        self._remotes: dict[str, RemoteEngine] = {}
        self.lock = threading.RLock()
        agent.register(cache)
        self.checks = CheckArea(agent)
        self.notices = NixlAgent(f"{agent.name}.notices")
        self.num_notices_sent = 0  # the data plane polls the notice agent (its progress) only after new ones
        self.num_host_copies = 0  # rank reads copied same-host instead of read over NIXL
        self.same_host = SameHostOpener(cache)
        self.abort_drain_s = ABORT_DRAIN_S
        self._retired: list[RemoteEngine] = []  # replaced connections with aborted transfers still running

    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo] | None = None, *, same_host: bool = False) -> RemoteEngine:
        """Plan and prepare reads from a remote engine (one cache, metadata and hold board per rank).

        Without ``boards`` nothing is checked: reads of memory nobody holds
        (benchmarks of the data path alone). The daemon always passes them, and
        then every read must carry each rank's capability for exactly its
        remote blocks (:mod:`kvxferd.plan.capability`), checked before it is posted.

        ``same_host``: the remote ranks proved they share this host; each whose
        cache names its memory (shared-memory objects, CUDA IPC handles) is
        opened here and read by copying (:mod:`kvxferd.xfer.samehost.hostmaps`,
        :mod:`kvxferd.xfer.samehost.devicemaps`), the others over NIXL.
        """
        with self.lock:
            return self._connect(remotes, metadata, boards, same_host)

    def _connect(self, remotes, metadata, boards, same_host: bool) -> RemoteEngine:
        plan = EngineTransferPlan(self.cache, remotes)
        if len(metadata) != len(remotes):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata for {len(remotes)} remote ranks")
        if boards is not None and len(boards) != len(remotes):
            raise InvalidArgumentError("boards", f"{len(boards)} hold boards for {len(remotes)} remote ranks")
        if plan.remote_engine_id in self._remotes:
            self.disconnect(plan.remote_engine_id)
        if boards is not None and any(len(b.hold_key) != HOLD_KEY_BYTES for b in boards):
            raise InvalidArgumentError("boards", "every remote rank's hold key is needed to check reads")
        remote = RemoteEngine(plan, (), {}, {}, board_buckets=tuple(b.num_buckets for b in boards or ()),
                              hold_keys=tuple(b.hold_key for b in boards or ()))
        names: list[str] = []
        num_notice_remotes = 0
        try:
            for q, m in enumerate(metadata):
                names.append(self.agent.add_remote(m, f"metadata[{q}]"))
                remote.agent_names = tuple(names)
                self.notices.add_remote(m, f"metadata[{q}]")
                num_notice_remotes += 1
                self.notices.connect_to(names[q])  # now, not on the first notice (which would stall reads)
            for rank_plan in plan.rank_plans:
                q = rank_plan.remote_rank
                remote.local_lists[q] = self.agent.prep_local(rank_plan.local_rows, self.cache.mem_type)
                remote.remote_lists[q] = self.agent.prep_remote(names[q], rank_plan.remote_rows, remotes[q].mem_type)
                if boards is not None:
                    remote.board_lists[q] = self.agent.prep_remote(
                        names[q], board_rows(boards[q].address, boards[q].num_buckets), "DRAM")
                if same_host:
                    try:
                        remote.host_ranks[q] = self.same_host.open(remotes[q], rank_plan)
                    except TransferError as err:
                        remote.host_errors[q] = err.message
        except BaseException:  # a bad peer leaves nothing behind
            self._unload(remote, num_notice_remotes)
            raise
        self._remotes[plan.remote_engine_id] = remote
        return remote

    def disconnect(self, engine_id: str) -> None:
        """Forget a remote engine: release its lists and its agents (once no aborted read of it still has a
        transfer running: until then it is retired, not released)."""
        with self.lock:
            remote = self._remotes.pop(engine_id, None)
            if remote is not None and remote.num_draining:
                self._retired.append(remote)
            elif remote is not None:
                self._unload(remote)

    def start_probe(self, remote: RemoteEngine) -> BoardProbe:
        """Post one READ of every remote rank's hold board (:class:`BoardProbe`), and send each holder the
        notice agent's ``HELLO``: a new connection's first transfer and first notification cost
        milliseconds here, not in a request. See :meth:`poll_probe`."""
        with self.lock:
            if remote.probe is None:
                for q in remote.plan.notify_ranks:
                    try:
                        self.notices.notify(remote.agent_names[q], HELLO)
                    except NixlError:
                        pass  # the probe's READ of that holder says whether it is reachable
                self.num_notices_sent += 1  # the data plane makes progress for the notice agent
                remote.probe = BoardProbe(self.checks, {q: (remote.board_lists[q], remote.board_buckets[q])
                                                        for q in remote.board_lists})
                remote.probe.poll()  # posts the READs (a check area with no free slot: the next poll)
            return remote.probe

    def poll_probe(self, remote: RemoteEngine) -> dict[int, str] | None:
        """None while the probe runs; then the error of each remote rank whose board did not answer.
        Raises :class:`TransferError` when the connection was released or replaced meanwhile."""
        with self.lock:
            if not self.is_current(remote):
                raise TransferError("remote_engine_id", "the connection was released while it was probed")
            if remote.probe is None:
                return {}
            errors = remote.probe.poll()
            if errors is not None:
                remote.probe = None
            return errors

    def abort_probe(self, remote: RemoteEngine, reason: str) -> None:
        with self.lock:
            if remote.probe is not None:
                remote.probe.abort(reason)
                remote.probe = None

    def _unload(self, remote: RemoteEngine, num_notice_remotes: int | None = None) -> None:
        self.abort_probe(remote, "the connection was released")
        lists = (remote.local_lists, remote.remote_lists, remote.board_lists)
        for handle in (h for handles in lists for h in handles.values()):
            handle.release()
        for handles in lists:  # a released handle still points at the agent: let go of it
            handles.clear()
        self.release_host_memory(remote, "the connection was released")
        names = remote.agent_names
        # One reference per rank and agent, as connect took them (a failed connect: only those it took).
        for agent, loaded in ((self.agent, names), (self.notices, names[:num_notice_remotes])):
            for name in loaded:
                try:
                    agent.remove_remote(name)
                except NixlError:
                    pass  # already removed (e.g. the peer went away)

    def close(self) -> None:
        """Disconnect every remote engine, deregister the local cache, destroy the agents."""
        with self.lock:
            for engine_id in list(self._remotes):
                self.disconnect(engine_id)
            while self._retired:  # the data plane failed their reads without drain before closing
                self._unload(self._retired.pop())
            self.checks.close()
            self.same_host.close()
            self.agent.deregister(self.cache.engine_id)
            self.agent.close()
            self.notices.close()

    def release_host_memory(self, remote: RemoteEngine, reason: str) -> None:
        """Unmap a remote engine's same-host memory (its holder changed or went away): its ranks read over
        NIXL until a new connection maps them again, and a dead holder's cache is not kept alive here."""
        with self.lock:
            drop_all(remote, reason)

    def progress_notices(self) -> None:
        """Make progress for the notice agent: UCX sends a notice on only while its agent is polled."""
        with self.lock:
            self.notices.poll_notifications()

    def notices_metadata(self) -> bytes:
        """The notice agent's metadata: how this rank introduces itself to holders as a reader."""
        with self.lock:
            return self.notices.metadata()

    def remote(self, engine_id: str) -> RemoteEngine:
        try:
            return self._remotes[engine_id]
        except KeyError:
            raise NotFoundError("remote_engine_id", f"no connected remote engine {engine_id!r}") from None

    def post(self, remote_engine_id: str, request: ReadRequest) -> InFlightRead:
        """Plan and post one request; bad input raises before anything is posted."""
        remote = self.remote(remote_engine_id)
        return self.post_planned(remote, remote.plan.plan_request(request))

    def is_current(self, remote: RemoteEngine) -> bool:
        """False once ``remote`` was disconnected or replaced by a new handshake."""
        return self._remotes.get(remote.plan.remote_engine_id) is remote

    def post_planned(self, remote: RemoteEngine, planned: PlannedRead, start_s: float | None = None) -> InFlightRead:
        """Post a request planned with ``remote.plan`` (which must be current: see :meth:`post_current`)."""
        with self.lock:
            return self._post_planned(remote, planned, start_s, notify=True)

    def post_current(self, remote: RemoteEngine, planned: PlannedRead, start_s: float | None = None, *,
                     notify: bool = True, sealed_for: RemoteEngine | None = None
                     ) -> tuple[RemoteEngine, PlannedRead, InFlightRead]:
        """Post on the remote engine's current connection: a request planned before a re-handshake is
        planned again on the new one (same layouts, new lists). Raises a typed error when it is gone.
        ``notify``: as in :meth:`poll` (the post polls once). ``sealed_for``: the connection whose hold
        keys the caller checked the read's capabilities against already (not checked again on it)."""
        with self.lock:
            if not self.is_current(remote):
                remote = self.remote(remote.plan.remote_engine_id)
                planned = remote.plan.plan_request(planned.request)
            return remote, planned, self._post_planned(remote, planned, start_s, notify=notify,
                                                       checked=remote is sealed_for)

    def _post_planned(self, remote: RemoteEngine, planned: PlannedRead, start_s: float | None, *,
                      notify: bool, checked: bool = False) -> InFlightRead:
        if remote.hold_keys and not checked:  # a read names only blocks its holders sealed for it: else nothing moves
            request = planned.request
            check_read_capabilities(remote.hold_keys, request.remote_request_id, request.remote_block_ids,
                                    request.remote_capabilities)
        inflight = InFlightRead(planned, remote, time.perf_counter() if start_s is None else start_s)
        if remote.board_lists:  # each rank's data waits for its board to show the hold (nothing copied before)
            capabilities = planned.request.remote_capabilities
            inflight.admitting = {read.remote_rank: read for read in planned.reads}
            inflight.tags = {q: hold_tag(capabilities[q]) for q in inflight.admitting}
            inflight.unchecked = list(inflight.admitting)
            self._post_checks(inflight)
        else:
            for read in planned.reads:
                self._post_read(inflight, read)
        inflight.posted_s = time.perf_counter()
        self.poll(inflight, notify=notify)
        return inflight

    def _post_read(self, inflight: InFlightRead, read: RankRead) -> None:
        """Post one rank's data READ (a failure is recorded on the read, never raised); from a same-host
        rank, copy it instead: it ends here."""
        remote, q = inflight.remote, read.remote_rank
        host_rank = remote.host_ranks.get(q)
        if host_rank is not None and self._copy_same_host(inflight, read, host_rank):
            return
        transfer = None
        try:
            transfer = NixlTransfer(self.agent, self.agent.make_read(remote.local_lists[q], read.local_ids,
                                                                     remote.remote_lists[q], read.remote_ids, b""))
            state = self.agent.post(transfer.handle)
        except NixlError as err:
            inflight.fail(q, str(err), nixl_failure(err))
            if transfer is not None:
                transfer.release()
            return
        if state is TransferState.ERR:
            inflight.fail(q, "transfer: posting reported an error", ReadFailure.TRANSFER)
            transfer.release()
        else:
            inflight.handles[q] = transfer
            if state is TransferState.PROC:
                inflight.waited_ranks.add(q)

    def _copy_same_host(self, inflight: InFlightRead, read: RankRead, host_rank: HostRank) -> bool:
        """Copy one rank's read from same-host memory (host memory: done here; GPU memory: its batch joins the
        handles). False when it goes over NIXL instead: the driver refused the batch, so nothing of it runs,
        and the rank reads over NIXL from now on."""
        q = read.remote_rank
        try:
            copied = host_rank.copy(read)
        except BatchRefused as err:
            drop_rank(inflight.remote, q, f"the driver refused a batch: {err.message}")
            return False
        except TransferError as err:
            inflight.fail(q, f"same-host copy: {err.message}", ReadFailure.TRANSFER)
            return True
        inflight.num_host_copies += 1
        self.num_host_copies += 1
        if host_rank.on_device:  # a batch on the device (devicemaps.py): it ends when its event does (poll)
            inflight.handles[q] = copied
        else:
            inflight.step += 1
            if inflight.tags:
                inflight.unchecked.append(q)  # the data is in: now ask the board whether it was still held
        return True

    def poll(self, inflight: InFlightRead, *, notify: bool = True) -> ReadResult | None:
        """Advance a posted request; returns its result once every rank's read and board check ended.

        With ``notify`` the holders' notices go out with the result; without, the
        caller sends them with :meth:`send_notices` once it has passed the result on
        (the holders' bookkeeping need not delay the engine: the checks already ran).
        """
        with self.lock:
            return self._poll(inflight, notify)

    def _poll(self, inflight: InFlightRead, notify: bool) -> ReadResult | None:
        if inflight.result is not None:
            if notify:
                self._send_notices(inflight)
            return inflight.result
        if inflight.draining and not self._settle(inflight):
            return None  # aborted: its transfers may still write (abort)
        # Checks first (a rank seen held posts its data), then data (a rank whose data is in posts its
        # second check), then checks again: over shared memory each ends inside its post, so a small
        # read ends in one poll.
        self._poll_checks(inflight)
        for q, transfer in list(inflight.handles.items()):
            state = transfer.state()
            if state is TransferState.PROC:
                continue
            inflight.step += 1
            if state is TransferState.ERR:
                self._transfer_failed(inflight, q, transfer.failure())
            elif inflight.tags:
                inflight.unchecked.append(q)  # the data is in: now ask the board whether it was still held
            inflight.handles.pop(q).release()
        if not inflight.handles and not inflight.admitting and not inflight.transferred_s:
            inflight.transferred_s = time.perf_counter()
        self._poll_checks(inflight)
        if inflight.handles or inflight.checks or inflight.unchecked or inflight.admitting:
            return None
        inflight.result = self._finish(inflight)
        if notify:
            self._send_notices(inflight)
        return inflight.result

    def wait(self, inflight: InFlightRead, timeout_s: float = 30.0) -> ReadResult:
        """Poll with a growing sleep (never a spinning core) until done or ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        sleep_s = POLL_MIN_S
        while (result := self.poll(inflight)) is None:
            if time.perf_counter() >= deadline and not inflight.drain_until_s:
                result = self.abort(inflight, f"deadline: not done after {timeout_s:g} s", ReadFailure.DEADLINE)
                if result is not None:
                    return result
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, POLL_MAX_S)
        return result

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
            return self._abort(inflight, reason, failure, drain)

    def _abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure, drain: bool) -> ReadResult | None:
        for q in list(inflight.handles):
            inflight.fail(q, reason, failure)
            inflight.draining[("data", q)] = (inflight.handles.pop(q), None)
        for q in [*inflight.checks, *inflight.unchecked]:
            inflight.fail(q, reason, failure)
            if q in inflight.checks:
                inflight.draining[("check", q)] = inflight.checks.pop(q)
        inflight.unchecked.clear()
        inflight.admitting.clear()  # never posted: nothing of theirs was copied
        if not inflight.drain_until_s:
            inflight.drain_until_s = time.perf_counter() + (self.abort_drain_s if drain else 0.0)
        if inflight.draining and not inflight.drain_counted:
            inflight.drain_counted = True
            inflight.remote.num_draining += 1
        if not drain:
            self._settle(inflight, force=True)
        return self._poll(inflight, notify=True)

    def _settle(self, inflight: InFlightRead, force: bool = False) -> bool:
        """Release every aborted transfer that ended (all of them past the drain deadline, or ``force``d);
        True when none is left."""
        past = force or time.perf_counter() >= inflight.drain_until_s
        for key, (handle, slot) in list(inflight.draining.items()):
            # slot None: a rank's data transfer (TransferHandle); else a board check's NIXL handle
            running = handle.running() if slot is None else self.agent.running(handle)
            if running and not past:
                continue
            del inflight.draining[key]
            if slot is None:
                inflight.unsettled |= running and not force  # its bytes may still land in the engine's blocks
                handle.release()  # a device batch: waits for it (devicemaps.py)
            else:
                self.checks.end(handle, slot, maybe_running=running)
        if inflight.draining or not inflight.drain_counted:
            return not inflight.draining
        inflight.drain_counted = False
        remote = inflight.remote
        remote.num_draining -= 1
        if not remote.num_draining and remote in self._retired:
            self._retired.remove(remote)
            self._unload(remote)
        return True

    def read(self, remote_engine_id: str, request: ReadRequest, timeout_s: float = 30.0) -> ReadResult:
        """Post and wait for one request."""
        return self.wait(self.post(remote_engine_id, request), timeout_s)

    # ---- internals ---------------------------------------------------------
    def _transfer_failed(self, inflight: InFlightRead, q: int, failure: TransferFailure) -> None:
        inflight.fail(q, failure.error, failure.kind)
        if failure.context_lost:
            for remote in self._remotes.values():  # the device's context is poisoned: no GPU rank copies any more
                drop_all(remote, failure.context_lost, on_device_only=True)

    def _check_state(self, inflight: InFlightRead, q: int, handle) -> TransferState:
        """A board check's state (a NIXL handle of :mod:`kvxferd.xfer.nixl.checks`)."""
        try:
            return self.agent.state(handle)
        except NixlError as err:
            inflight.fail(q, str(err), nixl_failure(err))
            return TransferState.ERR

    def _poll_checks(self, inflight: InFlightRead) -> None:
        """Post waiting board checks, then settle the ended ones: a rank seen held before its data READ
        posts it; a rank whose hold is gone is stale (before its READ: nothing of it was copied)."""
        self._post_checks(inflight)
        for q, (handle, slot) in list(inflight.checks.items()):
            state = self._check_state(inflight, q, handle)
            if state is TransferState.PROC:
                continue
            inflight.step += 1
            read = inflight.admitting.pop(q, None)  # None: the check after the data READ
            if state is TransferState.ERR:
                inflight.fail(q, "board check: reading the holder's hold board failed", ReadFailure.TRANSFER)
            elif not self.checks.found(slot, inflight.tags[q]):
                inflight.fail(q, STALE_ERROR if read is None else UNHELD_ERROR, ReadFailure.STALE)
                inflight.stale_ranks.add(q)
            elif read is not None:
                self._post_read(inflight, read)
            self._end_check(inflight, q)

    def _post_checks(self, inflight: InFlightRead) -> None:
        """Post the board checks of ranks waiting for one, while check slots are free."""
        remote = inflight.remote
        while inflight.unchecked:
            q = inflight.unchecked[0]
            try:
                posted = self.checks.post(remote.board_lists[q], remote.board_buckets[q], inflight.tags[q], remote)
            except NixlError as err:
                inflight.unchecked.pop(0)
                inflight.admitting.pop(q, None)
                inflight.fail(q, f"board check: {err}", nixl_failure(err))
                continue
            if posted is None:
                return  # every slot taken: the next poll tries again
            inflight.unchecked.pop(0)
            handle, slot, state = posted
            inflight.checks[q] = (handle, slot)
            if state is TransferState.PROC:
                inflight.waited_ranks.add(q)
            if state is TransferState.ERR:
                inflight.admitting.pop(q, None)
                inflight.fail(q, "board check: posting reported an error", ReadFailure.TRANSFER)
                self._end_check(inflight, q)

    def _end_check(self, inflight: InFlightRead, q: int) -> None:
        self.checks.end(*inflight.checks.pop(q))

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
        for q in planned.notify_ranks:
            if q in inflight.stale_ranks:
                continue
            capabilities = planned.request.remote_capabilities
            notice = ReadNotice(planned.request.remote_request_id, self.cache.engine_id, self.cache.tp_rank,
                                remote.plan.expected_notifiers[q], result.ok, alone=q not in inflight.waited_ranks,
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

    def _finish(self, inflight: InFlightRead) -> ReadResult:
        planned, remote = inflight.planned, inflight.remote
        ok = not inflight.errors
        request = planned.request
        failed = tuple(sorted(inflight.errors))
        invalid = planned.invalid_block_ids(failed) if failed else tuple(np.zeros(0, np.int64) for _ in planned.units)
        error = "; ".join([f"rank {q}: {inflight.errors[q]}" for q in failed]
                          + ([UNSETTLED_ERROR] if inflight.unsettled else [])) or None
        return ReadResult(request.request_id, remote.plan.remote_engine_id, ok,
                          sum(r.num_bytes for r in planned.reads if r.remote_rank not in inflight.errors),
                          sum(r.num_descriptors for r in planned.reads), time.perf_counter() - inflight.start_s,
                          invalid, failed, error, inflight.failure, inflight.unsettled)


STALE_ERROR = ("stale read: the hold had ended (lease expired or released) before the read was checked "
               "against the holder's board")
UNHELD_ERROR = ("stale read, nothing copied: the holder's board shows no live hold sealed by this capability "
                "(it ended, or never was) before the read was posted")
