"""The reader role of a data-plane worker: the engine's READs posted and polled here, not in the daemon.

::

    control plane (WorkerReadBackend)            reader worker (this module)
    ─────────────────────────────────            ──────────────────────────────────────────
    map {role: reader, cache, regions} + fds ──► the engine's regions mapped read-write, one agent
                                                 registering them (its metadata goes to no one)
    connect {id, remotes, metadata, boards,  ──► a ReadExecutor connection (plans, prepared lists);
             opened} + their fds                 same-host objects by the holder's fd, holders' pidfds:
                                                 the daemon's (xfer/samehost/opened.py)
                                             ◄── connected {id} / error {id, message}
    probe {id, engine_id} ─────────────────────► the connection's first READs (its boards)
                                             ◄── probed {id, errors}
    post {id, engine_id, request,  ────────────► admitted on its connection, posted, polled (past its
          deadline_in_s}                         deadline and DEADLINE_GRACE_S: aborted here, DEADLINE)
          (+ a memfd of its ids, when long)
                                             ◄── ended {id, failed_ranks, error, failure,
                                                        unsettled, transfer_s, host_copies, notices}
    abort {id, reason, failure, drain}           (its ended follows)
    disconnect / release_host {engine_id}

Notices are not sent from here: the holders were introduced to the notice
agent of the engine's holder worker, so the notices a read's executor would
send travel back with its ``ended`` and the control plane sends them on
(:class:`NoticeCollector`). Whoever owns this worker through a holder's
connection reaches this engine's cache and its connections: nothing of the
daemon, and no other tenant's memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from kvxferd.errors import InvalidArgumentError, KvxferError
from kvxferd.plan.board import BoardInfo
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import EngineCache, HostShare, RegionMemory
from kvxferd.plan.notifications import HELLO
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire import workerchannel as channel
from kvxferd.wire.messages import engine_from_pb, host_share_from_handle, peer_memory_from_pb, unpack_ids
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.admission import admit
from kvxferd.xfer.records import InFlightRead
from kvxferd.xfer.samehost.opened import OpenedObjects
from kvxferd.worker.sessionreads import SessionReads

MAX_IDS_BYTES = 64 << 20  # a read's packed block ids sent in a memfd: 8 M ids (the engine's messages: 16 MiB)
MAX_READS = 1 << 17  # reads one worker keeps in flight (a bound on its memory; the daemon's own limit,
                     # max_reads_per_engine, is 8192 by default)
FAILURES = {f.value: f for f in ReadFailure}
SESSION_OPS = frozenset({"session", "session_write", "session_end", "session_drop", "link", "handshake_failed",
                         "accepting"})
DEADLINE_GRACE_S = 1.0  # past its deadline a read waits this long for the daemon's abort, then ends here
MAX_DEADLINE_S = 24 * 3600.0  # a deadline_in_s beyond this (either way) is not one: the read keeps none
READER_OPS = frozenset({"connect", "probe", "abort_probe", "post", "abort", "disconnect", "release_host",
                        *SESSION_OPS})


class NoticeCollector:
    """Stands in for the executor's notice agent: keeps what it would send, for the control plane."""

    def __init__(self) -> None:
        self.pending: list[list[str]] = []

    def notify(self, agent_name: str, message: bytes) -> None:
        if message != HELLO:  # a probe's: the control plane sends those itself
            self.pending.append([agent_name, message.hex()])

    def take(self) -> list[list[str]]:
        pending, self.pending = self.pending, []
        return pending

    # The control plane loads holders and connects to them on the notice agent itself.
    def add_remote(self, metadata: bytes, field: str = "agent_metadata") -> str:
        return ""

    def remove_remote(self, name: str) -> None:
        pass

    def connect_to(self, agent_name: str) -> None:
        pass

    def poll_notifications(self) -> dict:
        return {}

    def metadata(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


def cache_of(message: dict, arrays: list) -> EngineCache:
    """The engine's cache as the control plane describes it (``cache``: an EngineRank, hex), its regions at
    the addresses this worker mapped them at, in order."""
    described = _engine_rank(message.get("cache"), "cache")
    counts = [len(g.regions) for g in described.groups]
    if sum(counts) != len(arrays):
        raise InvalidArgumentError("cache", f"{sum(counts)} regions described, {len(arrays)} mapped")
    memory, start = [], 0
    for count in counts:
        memory.append([RegionMemory(a.ctypes.data, a.nbytes) for a in arrays[start:start + count]])
        start += count
    return engine_from_pb(described, memory)


def _request(message: dict, fds: Sequence[int] = ()) -> ReadRequest:
    """The read a ``post`` carries (readbackend.request_message): its ids in hex, or in the memfd it sent."""
    r = message.get("request")
    if not isinstance(r, dict):
        raise InvalidArgumentError("request", "an object")
    caps = r.get("caps", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise InvalidArgumentError("request.caps", "a list of hex strings")
    if len(fds) > 1:
        raise InvalidArgumentError("request.ids_fd", "one memfd of ids at most")
    packed = channel.blob_of(r, "ids", fds, MAX_IDS_BYTES)
    local_bytes = _int(r, "local_bytes")
    if local_bytes > len(packed):
        raise InvalidArgumentError("request.local_bytes", f"{local_bytes} bytes of {len(packed)}")
    local_packed, remote_packed = packed[:local_bytes], packed[local_bytes:]
    local = unpack_ids(local_packed, list(r.get("local_sizes", [])), "local_block_ids")
    remote = unpack_ids(remote_packed, list(r.get("remote_sizes", [])), "remote_block_ids")
    tokens = r.get("num_tokens")
    return ReadRequest(str(r.get("request_id")), str(r.get("remote_request_id")), local, remote,
                       tokens if isinstance(tokens, int) and tokens > 0 else None,
                       tuple(bytes.fromhex(c) for c in caps))


def _int(message: dict, key: str) -> int:
    value = message.get(key)
    if not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(key, "a non-negative integer")
    return value


class ReaderRole:
    """One engine rank's reads, in this worker (see the module doc)."""

    def __init__(self, name: str, cache: EngineCache, sock=None) -> None:
        self.notices = NoticeCollector()
        self.executor = ReadExecutor(NixlAgent(name), cache, self.notices)
        self.sock = sock  # the channel to the control plane
        self.session = SessionReads(self.executor, self.notices, self._tell)  # the engine's, once handed over
        self.reads: dict[int, tuple[InFlightRead, float]] = {}  # id -> (posted read, when this worker ends it itself)
        self.notices_of: dict[int, list[list[str]]] = {}  # id -> notices its abort sent (it ends at the next poll)
        self.probes: dict[int, Any] = {}  # id -> the connection being probed

    @property
    def busy(self) -> bool:
        """Reads or probes in flight: poll again soon."""
        return bool(self.reads or self.probes or self.session.busy)

    def _tell(self, message: dict, fds: Sequence[int] = ()) -> None:
        """A one-way message to the control plane (fds closed once sent)."""
        try:
            channel.send(self.sock, message, fds)
        finally:
            channel.close_all(list(fds))

    def handle(self, op: str, message: dict, fds: Sequence[int] = ()) -> dict | None:
        """Carry out a reader command; an answer to send now, or None. Raises on a bad command. ``fds``: those
        that came with it (the caller closes them)."""
        ex = self.executor
        if op in SESSION_OPS:
            return self._session_op(op, message, fds)
        if op == "connect":
            n = _int(message, "id")
            self.session.reconnecting(str(message.get("engine_id")))  # its reads on the old connection end
            remotes = [engine_from_pb_hex(h) for h in _list(message, "remotes")]
            metadata = [bytes.fromhex(str(h)) for h in _list(message, "metadata")]
            boards = message.get("boards")
            board_infos = None if boards is None else [
                BoardInfo(int(b["address"]), int(b["num_buckets"]), bytes.fromhex(str(b["hold_key"])),
                          _board_share(b.get("share")))
                for b in boards]
            remote = ex.connect(remotes, metadata, board_infos, same_host=bool(message.get("same_host")),
                                opened=OpenedObjects.of_message(message.get("opened"), fds))
            return {"op": "connected", "id": n, "host_ranks": sorted(remote.host_ranks),
                    "host_errors": {str(q): e[:300] for q, e in remote.host_errors.items()},
                    "board_errors": {str(q): e[:300] for q, e in remote.board_errors.items()}}
        if op == "probe":
            n = _int(message, "id")
            remote = ex.remote(str(message.get("engine_id")))
            ex.start_probe(remote)
            self.probes[n] = remote
            return None
        if op == "abort_probe":
            for n, remote in list(self.probes.items()):
                if remote.plan.remote_engine_id == str(message.get("engine_id")):
                    ex.abort_probe(remote, "the handshake ended")
                    del self.probes[n]
            return None
        if op == "post":
            n = _int(message, "id")
            if len(self.reads) >= MAX_READS:
                raise InvalidArgumentError("post", f"{MAX_READS} reads in flight")
            remote = ex.remote(str(message.get("engine_id")))
            self.notices.take()  # (none: every read's are taken as it ends)
            inflight = ex.post(admit(remote, _request(message, fds)), notify=True)
            self.reads[n] = (inflight, _ends_by_s(message.get("deadline_in_s")))
            self.notices_of[n] = self.notices.take()  # a read that ended within its post sent them there
            return None
        if op == "abort":
            n = _int(message, "id")
            entry = self.reads.get(n)
            if entry is not None:
                failure = FAILURES.get(str(message.get("failure")), ReadFailure.ABORTED)
                drain_s = message.get("drain_s")
                if isinstance(drain_s, (int, float)) and 0 <= drain_s <= 600:
                    ex.abort_drain_s = float(drain_s)
                self.notices.take()  # (none: every read's are taken as it ends)
                ex.abort(entry[0], str(message.get("reason"))[:500], failure, drain=bool(message.get("drain", True)))
                self.notices_of[n] = self.notices.take()
            return None
        if op in ("disconnect", "release_host"):
            engine_id = str(message.get("engine_id"))
            if op == "disconnect":
                self.session.reconnecting(engine_id)
                ex.disconnect(engine_id)
            elif ex.connections.current.get(engine_id) is not None:
                ex.release_host_memory(ex.remote(engine_id), str(message.get("reason"))[:500])
            return None
        raise InvalidArgumentError("op", f"unknown op {op[:32]!r}")

    def _session_op(self, op: str, message: dict, fds: Sequence[int]) -> None:
        """The engine's session, handed over (``session``), and what the control plane tells it."""
        session = self.session
        if op == "session":
            session.adopt(message, fds)
        elif op == "session_write":
            session.write_frame(channel.blob_of(message, "frame", fds, channel.MAX_MESSAGE_BYTES))
        elif op == "session_end":
            session.end(_int(message, "code"), str(message.get("message", ""))[:1024])
        elif op == "link":
            session.link(str(message.get("engine_id")), bool(message.get("ready")))
        elif op == "handshake_failed":
            session.handshake_failed(str(message.get("engine_id")), str(message.get("error", ""))[:1000],
                                     _int(message, "refused_code"))
        elif op == "accepting":
            session.accepting = bool(message.get("accepting"))
        elif op == "session_drop":
            session.drop()
        return None

    def progress(self, sock) -> None:
        """Advance every read and probe; send what ended."""
        self.session.progress()
        ex = self.executor
        for n, remote in list(self.probes.items()):
            try:
                errors = ex.poll_probe(remote)
            except KvxferError as err:
                errors = {0: err.message}
            if errors is not None:
                del self.probes[n]
                channel.send(sock, {"op": "probed", "id": n, "errors": {str(q): e[:500] for q, e in errors.items()}})
        now = time.perf_counter()
        for n, (inflight, ends_by_s) in list(self.reads.items()):
            self.notices.take()  # (none: every read's are taken as it ends)
            if now >= ends_by_s and inflight.drain is None:  # the daemon's abort did not come: end it here
                ex.abort(inflight, "deadline: the reader worker ended the read (its daemon's abort did not come)",
                         ReadFailure.DEADLINE, drain=True)
                self.notices_of.setdefault(n, []).extend(self.notices.take())
            result = ex.poll(inflight, notify=True)
            if result is None:
                continue
            del self.reads[n]
            transfer_s = inflight.transferred_s - inflight.posted_s if inflight.transferred_s else 0.0
            notices = self.notices_of.pop(n, []) + self.notices.take()
            channel.send(sock, {"op": "ended", "id": n, "failed_ranks": list(result.failed_ranks),
                                "error": (result.error or "")[:2000], "failure": result.failure.value,
                                "unsettled": result.unsettled, "transfer_s": transfer_s,
                                "host_copies": inflight.num_host_copies, "notices": notices[:channel.MAX_NOTICES]})

    def close(self) -> None:
        self.session.close()
        self.executor.close()


def engine_from_pb_hex(text: Any) -> EngineCache:
    """A remote rank's cache (an EngineRank with addresses, hex), its memory as described."""
    described = _engine_rank(text, "remotes")
    return engine_from_pb(described, peer_memory_from_pb(described))


def _board_share(text: Any) -> HostShare | None:
    """A board's memfd as the daemon sent it (:func:`~kvxferd.wire.messages.host_share_hex`), or None."""
    if text is None:
        return None
    try:
        handle = pb.MemoryHandle.FromString(bytes.fromhex(str(text)))
    except (ValueError, DecodeError):
        raise InvalidArgumentError("boards", "a board's share: a MemoryHandle message, hex") from None
    return host_share_from_handle(handle, "boards.share")


def _ends_by_s(deadline_in_s: Any) -> float:
    """When this worker ends a read itself: DEADLINE_GRACE_S after the deadline its daemon sent (whose abort
    normally comes first); never, for a read sent without one."""
    if isinstance(deadline_in_s, (int, float)) and not isinstance(deadline_in_s, bool) \
            and -MAX_DEADLINE_S <= deadline_in_s <= MAX_DEADLINE_S:
        return time.perf_counter() + deadline_in_s + DEADLINE_GRACE_S
    return float("inf")


def _engine_rank(text: Any, field: str) -> pb.EngineRank:
    """An ``EngineRank`` message sent as hex; :class:`InvalidArgumentError` naming ``field`` if it is not one."""
    try:
        return pb.EngineRank.FromString(bytes.fromhex(str(text)))
    except (ValueError, DecodeError):
        raise InvalidArgumentError(field, "an EngineRank message, hex") from None


def _list(message: dict, key: str) -> list:
    value = message.get(key)
    if not isinstance(value, list):
        raise InvalidArgumentError(key, "a list")
    return value
