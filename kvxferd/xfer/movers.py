"""What moves a rank's data on a read: a NIXL READ, or a same-host copy (issue #37).

::

    move(connection, rank q, ids) ─ q's memory opened here? ─ yes ─► copy it (host memory: done in the
                                  │                                   kernel; GPU memory: a device batch)
                                  │                     driver refused the batch: q over NIXL from now on
                                  └─ no ──────────────────────────► make_prepped_xfer READ, posted

A push (a WRITE into the decode rank's blocks) is another mover for the same
rank machine (:mod:`kvxferd.xfer.rankmachine`).
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
        host_rank = remote.host_ranks.get(q)
        if host_rank is not None:
            try:
                copied = host_rank.copy(move)
            except BatchRefused as err:  # nothing of it runs: this rank reads over NIXL from now on
                drop_rank(remote, q, f"the driver refused a batch: {err.message}")
            except TransferError as err:
                return Posted(failure=TransferFailure(f"same-host copy: {err.message}", ReadFailure.TRANSFER))
            else:
                self.num_host_copies += 1
                # GPU memory: a batch on the device, it ends when its event does; host memory: in already.
                return Posted(copied if host_rank.on_device else None, copied_here=True)
        transfer = None
        try:
            transfer = NixlTransfer(self.agent, self.agent.make_read(remote.local_lists[q], move.local_ids,
                                                                     remote.remote_lists[q], move.remote_ids, b""))
            state = self.agent.post(transfer.handle)
        except NixlError as err:
            if transfer is not None:
                transfer.release()
            return Posted(failure=TransferFailure(str(err), nixl_failure(err)))
        if state is TransferState.ERR:
            transfer.release()
            return Posted(failure=TransferFailure("transfer: posting reported an error", ReadFailure.TRANSFER))
        return Posted(transfer, waited=state is TransferState.PROC)

    def transfer_failed(self, failure: TransferFailure) -> None:
        if failure.context_lost:  # the device's context is poisoned: no GPU rank copies any more
            for remote in self._connections():
                drop_all(remote, failure.context_lost, on_device_only=True)
