"""One rank's data transfer in a read, whatever moves it, behind one small protocol
(:class:`kvxferd.xfer.records.TransferHandle`).

A rank's bytes move as a NIXL READ (:class:`NixlTransfer`) or, from a
same-host GPU rank, as a batch of device copies
(:class:`kvxferd.xfer.samehost.devicemaps.PendingDeviceCopy`); a same-host copy of
host memory ends inside its call and needs no handle. The executor polls,
fails, drains and releases both the same way and never asks which::

    posted ──► state(): PROC ... ──► DONE ──────────────► release()
                                └──► ERR ──► failure() ──► release()
    aborted ──► running()? (an abandoned READ may still write) ──► release()
"""

from __future__ import annotations

from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState
from kvxferd.xfer.records import ReadFailure, TransferFailure


def nixl_failure(err: NixlError) -> ReadFailure:
    """NIXL's exception type says whether the remote agent is gone (nixlRemoteDisconnectError, nixlNotFoundError)."""
    name = type(err.cause).__name__
    return ReadFailure.REMOTE_GONE if "Disconnect" in name or "NotFound" in name else ReadFailure.TRANSFER


class NixlTransfer:
    """A posted NIXL READ of one rank."""

    __slots__ = ("agent", "handle", "_failure")

    def __init__(self, agent: NixlAgent, handle) -> None:
        self.agent, self.handle = agent, handle
        self._failure = TransferFailure("transfer: completed with an error", ReadFailure.TRANSFER)

    def state(self) -> TransferState:
        try:
            return self.agent.state(self.handle)
        except NixlError as err:
            self._failure = TransferFailure(str(err), nixl_failure(err))
            return TransferState.ERR

    def failure(self) -> TransferFailure:
        return self._failure

    def running(self) -> bool:
        return self.agent.running(self.handle)

    def release(self) -> None:
        try:
            self.agent.release(self.handle)
        except NixlError:
            pass  # the handle of a failed transfer may already be gone
