"""What moves a rank's data on a read: a NIXL READ, or a same-host copy (issue #37).

::

    move(connection, rank q, ids) ─ q's memory opened here? ─ yes ─► copy it (host memory: done in the
                                  │                                   kernel; GPU memory: a device batch)
                                  │                     driver refused the batch: q over NIXL from now on
                                  └─ no ──────────────────────────► make_prepped_xfer READ, posted

A push (a WRITE into the decode rank's blocks, :class:`WriteMover`) is another mover for the same
rank machine (:mod:`kvxferd.xfer.rankmachine`): a copy into a same-host target's memory mapped here
(host memory), else a NIXL WRITE.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvxferd.cuda.copies import BatchRefused
from kvxferd.errors import TransferError
from kvxferd.plan.engine import RankRead
from kvxferd.xfer.handles import ReadFailure, TransferFailure
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState
from kvxferd.xfer.nixl.transfers import NixlTransfer, nixl_failure
from kvxferd.xfer.rankmachine import Posted
from kvxferd.xfer.records import RemoteEngine
from kvxferd.xfer.samehost.ranks import drop_all, drop_rank


class ReadMover:
    """Reads a rank's blocks into the local cache registered with ``agent``."""

    def __init__(self, agent: NixlAgent, connections: Callable[[], Iterable[RemoteEngine]]) -> None:
        self.agent = agent
        self._connections = connections  # every connection of the executor (a lost device context drops all)
        self.num_host_copies = 0  # rank reads copied same-host instead of read over NIXL

    def move(self, remote: RemoteEngine, q: int, move: RankRead) -> Posted:
        copied = copy_here(remote, q, move, drop_rank)
        if copied is not None:
            self.num_host_copies += copied.copied_here
            return copied
        return post_nixl(self.agent.make_read, remote.local_lists[q], move.local_ids, remote.remote_lists[q],
                         move.remote_ids, self.agent)

    def transfer_failed(self, failure: TransferFailure) -> None:
        if failure.context_lost:  # the device's context is poisoned: no GPU rank copies any more
            for remote in self._connections():
                drop_all(remote, failure.context_lost, on_device_only=True)


class WriteMover:
    """Writes this rank's blocks into a target rank's (a push): the connection's local lists are this
    cache's spans, its remote lists the target's (:class:`kvxferd.xfer.pushes.PushTarget`)."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.num_host_copies = 0  # rank writes copied into a same-host target's memory instead of over NIXL

    def move(self, remote: RemoteEngine, q: int, move: RankRead) -> Posted:
        copied = copy_here(remote, q, move)
        if copied is not None:
            self.num_host_copies += copied.copied_here
            return copied
        return post_nixl(self.agent.make_write, remote.local_lists[q], move.local_ids, remote.remote_lists[q],
                         move.remote_ids, self.agent)

    def transfer_failed(self, failure: TransferFailure) -> None:
        pass  # a push copies host memory only: no device context to give up on


def copy_here(remote, q: int, move: RankRead, drop=None) -> Posted | None:
    """Copy rank ``q``'s part in this process when its memory is opened here (the rank's
    :class:`~kvxferd.xfer.samehost.hostmaps.HostRank` says which way); None: it goes over NIXL. ``drop``:
    what sends the rank over NIXL from now on when the driver refuses a device batch (None: the part fails)."""
    host_rank = remote.host_ranks.get(q)
    if host_rank is None:
        return None
    try:
        copied = host_rank.copy(move)
    except BatchRefused as err:  # nothing of it runs: this rank goes over NIXL from now on
        if drop is None:
            return Posted(failure=TransferFailure(f"same-host copy: {err.message}", ReadFailure.TRANSFER))
        drop(remote, q, f"the driver refused a batch: {err.message}")
        return None
    except TransferError as err:
        return Posted(failure=TransferFailure(f"same-host copy: {err.message}", ReadFailure.TRANSFER))
    # GPU memory: a batch on the device, it ends when its event does; host memory: in already.
    return Posted(copied if host_rank.on_device else None, copied_here=True)


def post_nixl(make, local_list, local_ids, remote_list, remote_ids, agent: NixlAgent) -> Posted:
    """Make a prepared transfer with ``make`` (the agent's make_read or make_write) and post it."""
    transfer = None
    try:
        transfer = NixlTransfer(agent, make(local_list, local_ids, remote_list, remote_ids, b""))
        state = agent.post(transfer.handle)
    except NixlError as err:
        if transfer is not None:
            transfer.release()
        return Posted(failure=TransferFailure(str(err), nixl_failure(err)))
    if state is TransferState.ERR:
        transfer.release()
        return Posted(failure=TransferFailure("transfer: posting reported an error", ReadFailure.TRANSFER))
    return Posted(transfer, waited=state is TransferState.PROC)
