"""Execute planned reads with NIXL: connect once, then one transfer per remote rank.

::

    connect(remote ranks' caches + agent metadata)       once per remote engine
      plan = EngineTransferPlan(local, remotes)          pure, validated
      add_remote_agent x T_r; prep_xfer_dlist x 2 per read rank (strided rows)
    post(request)                                         per request
      plan.plan_request -> ids per rank                  typed errors before any I/O
      make_prepped_xfer(ids, notice) + transfer per rank
    poll / wait                                           no busy spin
      check_xfer_state; on completion: standalone notices to unread holders,
      release handles, ReadResult (status, bytes, invalid block ids per group)

A failure of one rank fails that request only: its result lists the local
block ids the failed ranks were writing, and other requests carry on.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, NotFoundError
from kvxferd.plan.engine import EngineTransferPlan, PlannedRead, ReadRequest
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import ReadNotice
from kvxferd.xfer.agent import NixlAgent, NixlError, TransferState

POLL_MIN_S = 20e-6  # first sleep between state checks; doubles up to POLL_MAX_S
POLL_MAX_S = 1e-3


class ReadFailure(str, enum.Enum):
    """Why a read failed, set where it happens (a bounded metrics label, never parsed from a message)."""

    NONE = ""
    TRANSFER = "transfer"  # NIXL reported an error for a rank
    REMOTE_GONE = "remote_gone"  # the remote agent disconnected or is unknown
    DEADLINE = "deadline"  # the transfer or the holder's ack did not come in time
    STALE = "stale"  # the hold had ended before the holder acknowledged the read
    ABORTED = "aborted"  # the engine or the link went away under the read
    HANDSHAKE = "handshake"  # a re-handshake before posting failed
    REFUSED = "refused"  # refused before anything was posted (Reads stream)


@dataclass(frozen=True, eq=False)
class ReadResult:
    """How one request ended. A failure is data, not an exception."""

    request_id: str
    remote_engine_id: str
    ok: bool
    num_bytes: int
    num_descriptors: int  # posted, before NIXL merges contiguous neighbours
    duration_s: float
    invalid_block_ids: tuple[np.ndarray, ...]  # per group; empty when ok
    failed_ranks: tuple[int, ...] = ()
    error: str | None = None
    unnotified_ranks: tuple[int, ...] = ()  # holders a notice could not reach
    failure: ReadFailure = ReadFailure.NONE


@dataclass(eq=False)
class RemoteEngine:
    """A connected remote engine: its plan, agent names and prepared lists."""

    plan: EngineTransferPlan
    agent_names: tuple[str, ...]  # per remote rank
    local_lists: dict[int, object]  # per read rank: prepared local descriptors
    remote_lists: dict[int, object]


@dataclass(eq=False)
class InFlightRead:
    """A posted request; advance it with :meth:`ReadExecutor.poll`."""

    planned: PlannedRead
    remote: RemoteEngine
    start_s: float
    handles: dict[int, object] = field(default_factory=dict)  # rank -> transfer handle still running
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why it failed
    failure: ReadFailure = ReadFailure.NONE  # the first failure's kind
    result: ReadResult | None = None

    def fail(self, q: int, error: str, failure: ReadFailure) -> None:
        self.errors.setdefault(q, error)
        if self.failure is ReadFailure.NONE:
            self.failure = failure


class ReadExecutor:
    """Reads into one local engine rank's registered cache."""

    def __init__(self, agent: NixlAgent, cache: EngineCache) -> None:
        self.agent = agent
        self.cache = cache
        self._remotes: dict[str, RemoteEngine] = {}
        agent.register(cache)

    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes]) -> RemoteEngine:
        """Plan and prepare reads from a remote engine (one cache and metadata per rank)."""
        plan = EngineTransferPlan(self.cache, remotes)
        if len(metadata) != len(remotes):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata for {len(remotes)} remote ranks")
        if plan.remote_engine_id in self._remotes:
            self.disconnect(plan.remote_engine_id)
        names: list[str] = []
        local_lists, remote_lists = {}, {}
        try:
            for q, m in enumerate(metadata):
                names.append(self.agent.add_remote(m, f"metadata[{q}]"))
            for rank_plan in plan.rank_plans:
                q = rank_plan.remote_rank
                local_lists[q] = self.agent.prep_local(rank_plan.local_rows, self.cache.mem_type)
                remote_lists[q] = self.agent.prep_remote(names[q], rank_plan.remote_rows, remotes[q].mem_type)
        except BaseException:  # a bad peer leaves nothing behind
            self._unload(RemoteEngine(plan, tuple(names), local_lists, remote_lists))
            raise
        remote = RemoteEngine(plan, tuple(names), local_lists, remote_lists)
        self._remotes[plan.remote_engine_id] = remote
        return remote

    def disconnect(self, engine_id: str) -> None:
        """Forget a remote engine: release its lists and its agents."""
        remote = self._remotes.pop(engine_id, None)
        if remote is not None:
            self._unload(remote)

    def _unload(self, remote: RemoteEngine) -> None:
        for handle in (*remote.local_lists.values(), *remote.remote_lists.values()):
            handle.release()
        remote.local_lists.clear()  # a released handle still points at the agent: let go of it
        remote.remote_lists.clear()
        for name in remote.agent_names:  # one reference per rank, as connect took them
            try:
                self.agent.remove_remote(name)
            except NixlError:
                pass  # already removed (e.g. the peer went away)

    def close(self) -> None:
        """Disconnect every remote engine, deregister the local cache, destroy the agent."""
        for engine_id in list(self._remotes):
            self.disconnect(engine_id)
        self.agent.deregister(self.cache.engine_id)
        self.agent.close()

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
        """Post a request planned with ``remote.plan`` (which must be current)."""
        inflight = InFlightRead(planned, remote, time.perf_counter() if start_s is None else start_s)
        request = planned.request
        for read in planned.reads:
            q = read.remote_rank
            notice = self._notice(remote, request, q, ok=True)
            handle = None
            try:
                handle = self.agent.make_read(remote.local_lists[q], read.local_ids, remote.remote_lists[q],
                                              read.remote_ids, notice)
                state = self.agent.post(handle)
            except NixlError as err:
                inflight.fail(q, str(err), _nixl_failure(err))
                if handle is not None:
                    self._release(handle)
                continue
            if state is TransferState.ERR:
                inflight.fail(q, "transfer: posting reported an error", ReadFailure.TRANSFER)
                self._release(handle)
            else:
                inflight.handles[q] = handle
        self.poll(inflight)
        return inflight

    def poll(self, inflight: InFlightRead) -> ReadResult | None:
        """Advance a posted request; returns its result once every rank finished."""
        if inflight.result is not None:
            return inflight.result
        for q, handle in list(inflight.handles.items()):
            try:
                state = self.agent.state(handle)
            except NixlError as err:
                state = TransferState.ERR
                inflight.fail(q, str(err), _nixl_failure(err))
            if state is TransferState.PROC:
                continue
            if state is TransferState.ERR:
                inflight.fail(q, "transfer: completed with an error", ReadFailure.TRANSFER)
            self._release(inflight.handles.pop(q))
        if inflight.handles:
            return None
        inflight.result = self._finish(inflight)
        return inflight.result

    def wait(self, inflight: InFlightRead, timeout_s: float = 30.0) -> ReadResult:
        """Poll with a growing sleep (never a spinning core) until done or ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        sleep_s = POLL_MIN_S
        while (result := self.poll(inflight)) is None:
            if time.perf_counter() >= deadline:
                return self.abort(inflight, f"deadline: not done after {timeout_s:g} s", ReadFailure.DEADLINE)
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, POLL_MAX_S)
        return result

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure = ReadFailure.ABORTED) -> ReadResult:
        """Stop every rank still running (releasing a handle aborts its transfer) and finish."""
        for q in list(inflight.handles):
            inflight.fail(q, reason, failure)
            self._release(inflight.handles.pop(q))
        return self.poll(inflight)

    def read(self, remote_engine_id: str, request: ReadRequest, timeout_s: float = 30.0) -> ReadResult:
        """Post and wait for one request."""
        return self.wait(self.post(remote_engine_id, request), timeout_s)

    # ---- internals ---------------------------------------------------------
    def _notice(self, remote: RemoteEngine, request: ReadRequest, q: int, *, ok: bool) -> bytes:
        return ReadNotice(request.remote_request_id, self.cache.engine_id, self.cache.tp_rank,
                          remote.plan.expected_notifiers[q], ok).encode()

    def _release(self, handle) -> None:
        try:
            self.agent.release(handle)
        except NixlError:
            pass  # the handle of a failed transfer may already be gone

    def _finish(self, inflight: InFlightRead) -> ReadResult:
        planned, remote = inflight.planned, inflight.remote
        ok = not inflight.errors
        read_ranks = {r.remote_rank for r in planned.reads}
        # Holders that were not read (replicas, nothing to read) or whose read failed
        # get a standalone notice; a successful read carried its notice already.
        unnotified = []
        for q in planned.notify_ranks:
            if q in read_ranks and q not in inflight.errors:
                continue
            try:
                self.agent.notify(remote.agent_names[q], self._notice(remote, planned.request, q, ok=ok))
            except NixlError:
                unnotified.append(q)  # the peer is gone; its hold expires on its side
        failed = tuple(sorted(inflight.errors))
        invalid = planned.invalid_block_ids(failed) if failed else tuple(np.zeros(0, np.int64) for _ in planned.units)
        error = "; ".join(f"rank {q}: {inflight.errors[q]}" for q in failed) or None
        return ReadResult(planned.request.request_id, remote.plan.remote_engine_id, ok,
                          sum(r.num_bytes for r in planned.reads if r.remote_rank not in inflight.errors),
                          sum(r.num_descriptors for r in planned.reads), time.perf_counter() - inflight.start_s,
                          invalid, failed, error, tuple(unnotified), inflight.failure)


def _nixl_failure(err: NixlError) -> ReadFailure:
    """NIXL's exception type says whether the remote agent is gone (nixlRemoteDisconnectError, nixlNotFoundError)."""
    name = type(err.cause).__name__
    return ReadFailure.REMOTE_GONE if "Disconnect" in name or "NotFound" in name else ReadFailure.TRANSFER
