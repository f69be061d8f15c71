"""The data-plane backend seam: what the daemon needs of whatever moves a read's bytes.

::

    service (ReadPath, DataPlane, Peers)          backend (one per local engine rank)
    ────────────────────────────────────          ──────────────────────────────────────
    handshake ─────────────── connect ──────────► prepare for a remote engine: its plan,
                                                  lists, boards (RemoteEngine)
              ◄──── start_probe / poll_probe ───  first transfer of a new connection
    post a read ─────────────────── post ───────► admitted again if re-handshaken; board
                                                  checks and data, rank by rank
    poll it ─────────────────── poll / abort ───► ReadResult once every rank ended
    after the completion ────── send_notices ───► tell each holder how it went
    a push's expectation ────── notify_holder ──► one record to a holder (issue #57)
    data-plane thread ───── progress_notices ───► keep notices moving (num_notices_sent)

NIXL (:class:`kvxferd.xfer.reads.ReadExecutor`) is the backend today. The
same-host paths of issue #37 (host memory and GPU memory) live inside it,
as a per-rank choice of how a rank's data moves (:mod:`kvxferd.xfer.samehost.hostmaps`,
:mod:`kvxferd.xfer.samehost.devicemaps`): their board checks and notices stay NIXL's,
and one remote engine may have ranks of both kinds. The service layer calls
a slot's backend through these members only (``tests/xfer/test_backend.py``
reads the service's source to check it), so another backend would change
neither the read's record, the session nor the books.

``lock`` lets one thread at a time into the backend (every member takes
it): the event loop posts small reads while the data-plane thread polls
the rest, and a caller may hold it across several calls.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from kvxferd.plan.board import BoardInfo
from kvxferd.plan.groups import EngineCache
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.records import AdmittedRead, InFlightRead, ReadResult, RemoteEngine
from kvxferd.xfer.samehost.opened import OpenedObjects


class ReadBackend(Protocol):
    """Reads into one local engine rank's registered cache, from remote engines' caches."""

    lock: threading.RLock
    num_notices_sent: int  # grows with every batch of notices sent: the data plane then makes progress
    abort_drain_s: float  # how long an aborted read waits for transfers that cannot be stopped (abort)
    # True: its reads end on another thread, which wakes the poller (no polling needed meanwhile, and a post
    # never ends within itself); False: poll() is what advances them.
    wakes_when_done: bool

    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo] | None = None, *, same_host: bool = False,
                opened: OpenedObjects | None = None) -> RemoteEngine:
        """Prepare reads from a remote engine (a cache, agent metadata and hold board per rank); ``same_host``:
        the ranks proved they share this host, and those that named their shared memory are copied from;
        ``opened``: the objects engines passed by fd, opened by the caller (it keeps and closes them)."""

    def disconnect(self, engine_id: str) -> None:
        """Forget a remote engine and release what :meth:`connect` prepared."""

    def release_host_memory(self, remote: RemoteEngine, reason: str) -> None:
        """Unmap a remote engine's same-host memory; its ranks read over NIXL until it is connected again."""

    def is_current(self, remote: RemoteEngine) -> bool:
        """False once ``remote`` was disconnected or replaced by a new connect."""

    def start_probe(self, remote: RemoteEngine) -> object:
        """Begin the first transfer of a new connection (its set-up cost paid here, not by a read)."""

    def poll_probe(self, remote: RemoteEngine) -> dict[int, str] | None:
        """None while the probe runs, then the error of each remote rank that did not answer."""

    def abort_probe(self, remote: RemoteEngine, reason: str) -> None:
        """Stop a probe still running."""

    def post(self, admitted: AdmittedRead, start_s: float | None = None, *, notify: bool = True,
             deadline_in_s: float | None = None) -> InFlightRead:
        """Post a read (:func:`kvxferd.xfer.admission.admit`) on the remote engine's current connection,
        admitted again there when it was admitted on another; typed errors, nothing posted. The caller
        enforces the read's deadline (:meth:`abort`); ``deadline_in_s``, when it comes, is for a backend
        whose reads run in another process, to end them there should that abort not arrive."""

    def poll(self, inflight: InFlightRead, *, notify: bool = True) -> ReadResult | None:
        """Advance a posted read; its result once every rank's transfer and board check ended."""

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure = ReadFailure.ABORTED, *,
              drain: bool = True) -> ReadResult | None:
        """Fail a read still running. With ``drain`` its result waits (None meanwhile: poll it) until no transfer
        of it can still write, at most ``abort_drain_s``; without, it is finished at once (its memory goes)."""

    def send_notices(self, inflight: InFlightRead) -> None:
        """Tell every holder how a finished read went, once."""

    def progress_notices(self) -> None:
        """Let notices already sent go on (nothing arrives here)."""

    def notify_holder(self, agent_name: str, message: bytes) -> None:
        """Send one record to a holder's agent from the notice agent it knows this rank by (a push's
        expectation, issue #57); raises :class:`~kvxferd.errors.KvxferError` when it cannot be sent."""

    def notices_metadata(self) -> bytes:
        """How this rank introduces itself to holders as a reader (its notices' sender)."""

    def close(self) -> None:
        """Disconnect every remote engine and release the local registration."""
