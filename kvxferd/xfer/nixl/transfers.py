"""A rank's data moved by NIXL: one posted READ (or, for a push, WRITE) behind
:class:`kvxferd.xfer.handles.TransferHandle`, and how a NIXL error becomes a :class:`ReadFailure`."""

from __future__ import annotations

from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState
from kvxferd.xfer.handles import ReadFailure, TransferFailure


def nixl_failure(err: NixlError) -> ReadFailure:
    """NIXL's exception type says whether the remote agent is gone (nixlRemoteDisconnectError, nixlNotFoundError)."""
    name = type(err.cause).__name__
    return ReadFailure.REMOTE_GONE if "Disconnect" in name or "NotFound" in name else ReadFailure.TRANSFER


class NixlTransfer:
    """A posted NIXL READ of one rank."""

    __slots__ = ("agent", "handle", "_failure")
    lands_in_blocks = True

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
