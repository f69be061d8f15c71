"""A reader's connections to remote engines: planned, prepared and probed once, released once unused.

::

    connect(remote ranks' caches + agent metadata + boards)    once per remote engine
      plan = EngineTransferPlan(local, remotes)                pure, validated
      add_remote_agent x T_r (reader and notice agent); prep_xfer_dlist x 3 per read
      rank (strided rows: local, remote, the holder's board); same-host ranks opened
    probe: one READ of every board, a HELLO to every holder   UCX's set-up paid here
    disconnect: released at once, or retired while an aborted read of it may still
      have a transfer running (released once the last one drained)

Not thread-safe: the executor's lock lets one thread in.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxferd.errors import InvalidArgumentError, NotFoundError, TransferError
from kvxferd.plan.board import BoardInfo
from kvxferd.plan.capability import HOLD_KEY_BYTES
from kvxferd.plan.engine import EngineTransferPlan
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import HELLO
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError
from kvxferd.xfer.nixl.checks import BoardProbe, CheckArea, board_rows
from kvxferd.xfer.records import RemoteEngine
from kvxferd.xfer.samehost.opened import OpenedObjects
from kvxferd.xfer.samehost.ranks import SameHostOpener, drop_all


class Connections:
    """The remote engines one local engine rank reads from (one :class:`RemoteEngine` each)."""

    def __init__(self, agent: NixlAgent, notices: NixlAgent, cache: EngineCache, checks: CheckArea) -> None:
        self.agent, self.notices, self.cache, self.checks = agent, notices, cache, checks
        self.same_host = SameHostOpener(cache)
        self.current: dict[str, RemoteEngine] = {}  # remote engine id -> its connection
        self.retired: list[RemoteEngine] = []  # replaced connections with aborted transfers still running

    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo] | None, same_host: bool,
                opened: OpenedObjects | None = None) -> RemoteEngine:
        """See :meth:`kvxferd.xfer.reads.ReadExecutor.connect`. A bad peer leaves nothing behind."""
        plan = EngineTransferPlan(self.cache, remotes)
        if len(metadata) != len(remotes):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata for {len(remotes)} remote ranks")
        if boards is not None and len(boards) != len(remotes):
            raise InvalidArgumentError("boards", f"{len(boards)} hold boards for {len(remotes)} remote ranks")
        if plan.remote_engine_id in self.current:
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
                        remote.host_ranks[q], board_error = self.same_host.open(
                            remotes[q], rank_plan, opened, None if boards is None else boards[q])
                    except TransferError as err:
                        remote.host_errors[q] = err.message
                    else:
                        if board_error:
                            remote.board_errors[q] = board_error
        except BaseException:
            self._unload(remote, num_notice_remotes)
            raise
        self.current[plan.remote_engine_id] = remote
        return remote

    def remote(self, engine_id: str) -> RemoteEngine:
        try:
            return self.current[engine_id]
        except KeyError:
            raise NotFoundError("remote_engine_id", f"no connected remote engine {engine_id!r}") from None

    def is_current(self, remote: RemoteEngine) -> bool:
        return self.current.get(remote.plan.remote_engine_id) is remote

    def disconnect(self, engine_id: str) -> None:
        remote = self.current.pop(engine_id, None)
        if remote is not None and remote.num_draining:
            self.retired.append(remote)
        elif remote is not None:
            self._unload(remote)

    def drained(self, remote: RemoteEngine) -> None:
        """An aborted read of ``remote`` has no transfer running any more."""
        remote.num_draining -= 1
        if not remote.num_draining and remote in self.retired:
            self.retired.remove(remote)
            self._unload(remote)

    def start_probe(self, remote: RemoteEngine) -> BoardProbe:
        """See :meth:`kvxferd.xfer.reads.ReadExecutor.start_probe`."""
        if remote.probe is None:
            for q in remote.plan.notify_ranks:
                try:
                    self.notices.notify(remote.agent_names[q], HELLO)
                except NixlError:
                    pass  # the probe's READ of that holder says whether it is reachable
            remote.probe = BoardProbe(self.checks, {q: (remote.board_lists[q], remote.board_buckets[q])
                                                    for q in remote.board_lists})
            remote.probe.poll()  # posts the READs (a check area with no free slot: the next poll)
        return remote.probe

    def poll_probe(self, remote: RemoteEngine) -> dict[int, str] | None:
        if not self.is_current(remote):
            raise TransferError("remote_engine_id", "the connection was released while it was probed")
        if remote.probe is None:
            return {}
        errors = remote.probe.poll()
        if errors is not None:
            remote.probe = None
        return errors

    def abort_probe(self, remote: RemoteEngine, reason: str) -> None:
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
        drop_all(remote, "the connection was released")
        names = remote.agent_names
        # One reference per rank and agent, as connect took them (a failed connect: only those it took).
        for agent, loaded in ((self.agent, names), (self.notices, names[:num_notice_remotes])):
            for name in loaded:
                try:
                    agent.remove_remote(name)
                except NixlError:
                    pass  # already removed (e.g. the peer went away)

    def close(self) -> None:
        """Release every connection, the retired ones too (their reads were failed without drain)."""
        for engine_id in list(self.current):
            self.disconnect(engine_id)
        while self.retired:
            self._unload(self.retired.pop())
        self.same_host.close()
