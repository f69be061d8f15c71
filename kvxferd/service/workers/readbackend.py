"""An engine rank's reads posted by a worker of their own (issue #55): the daemon holds no agent for them.

::

    data-plane thread / event loop              supervisor thread          reader worker
    ──────────────────────────────              ─────────────────          ─────────────────────
    connect: plan here (the loop admits       ─ connect {id, ...} ────────► connected {id}: its
      and seals with it), the holders loaded                                 connection (plans,
      on the notice agent (WorkerNotices)     ◄── _answer ────────────────  lists, boards)
    post: admitted here, sent once ─────────── post {id, request} ───────► admitted there, posted,
      (never blocks; a full or dead channel:                                polled, board-checked
      REMOTE_GONE, the read is not posted)
    poll: its result once ``ended`` came      ◄── _answer: ended {id, ...} ─ (the notices its read
      (the thread is woken: no spinning)          result built here          would send, with it)
    send_notices ──► WorkerNotices (the holder worker's notice agent: what holders were introduced to)

What a worker says is checked as untrusted: a result names only ranks of
the read's plan, and its invalid block ids are computed here from them;
its notices go only to the holders of the read's connection. A worker that
dies fails every read it had (every block of the plan invalid: the engine
recomputes) and every connection (the next read re-handshakes, on the next
generation). See docs/dataplane.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.errors import InvalidArgumentError, NotFoundError, TransferError, UnavailableError, status_number
from kvxferd.plan.board import BoardInfo
from kvxferd.plan.capability import HOLD_KEY_BYTES
from kvxferd.plan.engine import EngineTransferPlan
from kvxferd.plan.groups import EngineCache
from kvxferd.plan.notifications import HELLO
from kvxferd.service.workers.generation import Region, WorkerDeath
from kvxferd.service.workers.notices import WorkerNotices
from kvxferd.service.workers.supervisor import SESSION_EVENTS, WorkerSupervisor
from kvxferd.wire import workerchannel as channel
from kvxferd.wire.messages import engine_to_pb, host_share_hex, pack_ids
from kvxferd.xfer.admission import admit
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.agent import agent_name_of
from kvxferd.xfer.reads import ABORT_DRAIN_S
from kvxferd.xfer.records import AdmittedRead, Drain, InFlightRead, ReadResult, ReadTimes, RemoteEngine
from kvxferd.xfer.samehost.opened import OpenedObjects, open_passed_objects

log = logging.getLogger("kvxferd.workers")
# A worker's answer to connect (loading T agents, preparing lists: milliseconds). The data-plane thread waits
# for it, as it waits for an in-process connect: a worker that does not answer stalls it this long.
CONNECT_TIMEOUT_S = 5.0
# A worker's session events the control plane's loop has not taken yet: past this the worker floods it (a
# pass sends a few; a hostile worker could send a message per microsecond): it is killed, as for any
# message out of protocol.
MAX_SESSION_EVENTS_PENDING = 1024
FAILURES = {f.value: f for f in ReadFailure}


@dataclass(eq=False)
class WorkerRead(InFlightRead):
    """A read the reader worker posts (its ranks are kept there): its number on the channel, the ranks it
    copied same-host, and the notices it made, sent on by :meth:`WorkerReadBackend.send_notices`."""

    ticket: int = 0
    copied_elsewhere: int = 0
    worker_notices: tuple = ()
    generation: int = 0  # the worker generation it was sent to (a replaced one serves its reads to the end)

    @property
    def num_host_copies(self) -> int:
        return self.copied_elsewhere


@dataclass(eq=False)
class _Probe:
    """A connection's probe as the handshake sees it (``waiting``/``running``: its ranks, for a timeout)."""

    ticket: int
    waiting: set[int]
    running: set[int] = field(default_factory=set)


class WorkerReadBackend:
    """A :class:`kvxferd.xfer.backend.ReadBackend` whose NIXL work runs in a reader worker."""

    wakes_when_done = True  # a result arrives on another thread, which wakes the data plane: no polling

    def __init__(self, name: str, region_fds: Sequence[tuple[int, int, int]], cache: EngineCache,
                 notices: WorkerNotices, *, poll_interval_s: float, wake: Callable[[], None],
                 on_death: Callable[[], None] | None = None, on_lost: Callable[[], None] | None = None,
                 on_replace: Callable[[tuple[str, ...]], None] | None = None) -> None:
        """``region_fds``: (fd, offset, num_bytes) of each of ``cache``'s regions, in its order; ``notices``: the
        engine's notice agent (its holder worker's); ``wake``: wakes whoever polls (the data-plane thread);
        ``on_lost``: the worker's connections are gone (it died, or was replaced: the caller's links must
        handshake again); ``on_replace``: a replacement started, for these reasons."""
        if len(region_fds) != sum(len(m) for m in cache.memory):
            raise InvalidArgumentError("regions", "a reader worker maps every region of the cache from its fd")
        self.cache, self.notices, self._wake, self._on_death, self._on_lost = cache, notices, wake, on_death, on_lost
        self.on_session: Callable[[dict], None] | None = None  # the session's events (service/net/sessions.py)
        self.session_events_pending = 0  # handed to the loop, not taken yet
        self.lock = threading.RLock()
        self._closing = False
        self.num_notices_sent = 0
        self.abort_drain_s = ABORT_DRAIN_S
        self._state = threading.Condition()  # the tables below: this class's callers and the supervisor's thread
        self._tickets = itertools.count(1)
        self._answers: dict[int, dict | None] = {}  # ticket -> answer (None: waited for, not come yet)
        self._reads: dict[int, InFlightRead] = {}
        self.current: dict[str, RemoteEngine] = {}
        self._probes: dict[int, _Probe] = {}  # id(remote) -> its probe
        described = engine_to_pb(cache, with_addresses=False).SerializeToString().hex()
        self.supervisor = WorkerSupervisor(name, [Region(fd, n, offset) for fd, offset, n in region_fds],
                                           poll_interval_s=poll_interval_s, reader={"cache": described},
                                           on_answer=self._answer, on_death=self._died, on_up=self._up,
                                           on_replace=on_replace, on_retired=self._retired)

    def begin(self) -> None:
        """Start the worker without waiting for it (:meth:`start` waits)."""
        self.supervisor.begin()

    def start(self) -> None:
        """Start the worker; blocks until it mapped the cache (about 1-2 s)."""
        self.supervisor.start()

    def replace(self, reason: str) -> None:
        """Trust in the holders this worker connected to ended (a CA withdrawn): each learned its UCX address
        when it connected, and its agent listens on TCP. A new worker, make before break: reads in flight
        end on the old one, which stops after its grace; connections do not carry over (:meth:`_up`)."""
        if not self._closing:
            self.supervisor.replace(reason)

    def _retired(self, generation: int) -> None:
        """A replaced generation was stopped after its grace: a read it still had never ends there."""
        with self._state:
            reads = [r for r in self._reads.values() if r.generation == generation]
        for inflight in reads:
            self._fail_whole(inflight, "the replaced reader worker stopped with the read in flight", ReadFailure.TRANSFER,
                             unsettled=False)

    def _up(self, up) -> None:
        """A generation mapped (the supervisor's thread, before anything is sent to it). After a replacement
        the connections are the old generation's: gone from here, and every link handshakes again, with
        this one, before its next read. (After a death :meth:`_died` did this already.) The engine's session,
        if the old one serves it, is dropped there without a word: the client opens it again, here."""
        self._lose_connections(always_tell=False)
        if up.generation > 1:
            self.supervisor.send_to(up.generation - 1, {"op": "session_drop"})

    def _lose_connections(self, *, always_tell: bool) -> None:
        """Forget every connection (they were a generation's that serves no more): the holders they loaded on
        the notice agent unloaded, and the caller's links told (``on_lost``) when there were any, or
        ``always_tell``."""
        with self._state:
            remotes, self.current = list(self.current.values()), {}
        for remote in remotes:
            self._unload(remote.agent_names)
        if (remotes or always_tell) and self._on_lost is not None and not self._closing:
            self._on_lost()

    # ---- connections ------------------------------------------------------------
    def connect(self, remotes: Sequence[EngineCache], metadata: Sequence[bytes],
                boards: Sequence[BoardInfo] | None = None, *, same_host: bool = False,
                opened: OpenedObjects | None = None) -> RemoteEngine:
        """Plan here, connect in the worker (its answer awaited), load the holders on the notice agent."""
        plan = EngineTransferPlan(self.cache, remotes)
        if len(metadata) != len(remotes):
            raise InvalidArgumentError("metadata", f"{len(metadata)} agent metadata for {len(remotes)} remote ranks")
        if boards is not None and (len(boards) != len(remotes) or any(len(b.hold_key) != HOLD_KEY_BYTES
                                                                      for b in boards)):
            raise InvalidArgumentError("boards", "a hold board, with its hold key, per remote rank")
        names = tuple(agent_name_of(m, f"metadata[{q}]") for q, m in enumerate(metadata))
        self.disconnect(plan.remote_engine_id)
        # Objects the holders' engines passed by fd lie behind /proc/<holder>/fd, which the worker's
        # sandbox keeps it out of: opened (and checked) here, handed over with the command.
        ours = opened is None and same_host
        if ours:
            opened = open_passed_objects(remotes, boards or ())
        objects, fds = opened.message() if same_host and opened is not None else (None, [])
        # The handshake holds self.lock across this (links.py: no read posted between failing the old
        # connection's reads and the swap), so the loop's small reads wait for the worker's answer too:
        # milliseconds, at most CONNECT_TIMEOUT_S from a worker that does not answer.
        try:
            answer = self._ask({"op": "connect", "engine_id": plan.remote_engine_id,
                                "remotes": [engine_to_pb(c, with_addresses=True, with_shares=True, vmm_shares=False)
                                            .SerializeToString().hex() for c in remotes],
                                "metadata": [m.hex() for m in metadata], "same_host": same_host, "opened": objects,
                                "boards": None if boards is None else [
                                    {"address": b.address, "num_buckets": b.num_buckets, "hold_key": b.hold_key.hex(),
                                     "share": None if b.share is None else host_share_hex(b.share)}
                                    for b in boards]}, fds)
        finally:
            if ours and opened is not None:
                opened.close()
        remote = RemoteEngine(plan, names, {}, {}, board_buckets=tuple(b.num_buckets for b in boards or ()),
                              hold_keys=tuple(b.hold_key for b in boards or ()))
        remote.host_ranks = {q: None for q in _ints(answer.get("host_ranks"), len(names))}
        errors = answer.get("host_errors")
        remote.host_errors = {q: str(errors[k])[:300] for k, q in _ranks(errors, len(names))}
        errors = answer.get("board_errors")
        remote.board_errors = {q: str(errors[k])[:300] for k, q in _ranks(errors, len(names)) if q in remote.host_ranks}
        loaded = 0
        try:
            for q, m in enumerate(metadata):  # the engine's notices go out from its holder worker
                self.notices.add_remote(m, f"metadata[{q}]")
                loaded += 1
                self.notices.connect_to(names[q])
        except BaseException:
            self._unload(names[:loaded])
            self.supervisor.send({"op": "disconnect", "engine_id": plan.remote_engine_id})
            raise
        with self.lock, self._state:
            self.current[plan.remote_engine_id] = remote
        return remote

    def disconnect(self, engine_id: str) -> None:
        with self.lock:
            with self._state:
                remote = self.current.pop(engine_id, None)
            if remote is not None:
                self._probes.pop(id(remote), None)
                self._unload(remote.agent_names)
                self.supervisor.send({"op": "disconnect", "engine_id": engine_id})

    def _unload(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                self.notices.remove_remote(name)
            except Exception:  # noqa: BLE001 - already gone with its generation
                pass

    def remote(self, engine_id: str) -> RemoteEngine:
        with self._state:
            remote = self.current.get(engine_id)
        if remote is None:
            raise NotFoundError("remote_engine_id", f"no connected remote engine {engine_id!r}")
        return remote

    def is_current(self, remote: RemoteEngine) -> bool:
        with self._state:
            return self.current.get(remote.plan.remote_engine_id) is remote

    def release_host_memory(self, remote: RemoteEngine, reason: str) -> None:
        with self.lock:
            if self.is_current(remote) and remote.host_ranks:
                remote.host_ranks.clear()
                self.supervisor.send({"op": "release_host", "engine_id": remote.plan.remote_engine_id,
                                      "reason": reason[:200]})

    def start_probe(self, remote: RemoteEngine) -> _Probe:
        """The holders' HELLO from the notice agent, and the worker's READ of every board."""
        with self.lock:
            probe = self._probes.get(id(remote))
            if probe is None:
                for q in remote.plan.notify_ranks:
                    try:
                        self.notices.notify(remote.agent_names[q], HELLO)
                    except Exception:  # noqa: BLE001 - the probe's READ says whether it is reachable
                        pass
                self.num_notices_sent += 1
                ticket = next(self._tickets)
                with self._state:
                    self._answers[ticket] = None
                probe = self._probes[id(remote)] = _Probe(ticket, set(range(len(remote.agent_names))))
                if not self.supervisor.send({"op": "probe", "id": ticket, "engine_id": remote.plan.remote_engine_id}):
                    self._answer(0, {"op": "probed", "id": ticket, "errors": {"0": "the reader worker is not up"}})
            return probe

    def poll_probe(self, remote: RemoteEngine) -> dict[int, str] | None:
        if not self.is_current(remote):
            raise TransferError("remote_engine_id", "the connection was released while it was probed")
        probe = self._probes.get(id(remote))
        if probe is None:
            return {}
        with self._state:
            answer = self._answers.get(probe.ticket)
            if answer is None:
                return None
            del self._answers[probe.ticket]
        self._probes.pop(id(remote), None)
        if answer["op"] == "error":
            return {0: str(answer.get("message"))[:500]}
        errors = answer.get("errors")
        if not isinstance(errors, dict) or len(_ranks(errors, len(remote.agent_names))) != len(errors):
            return {0: "a probe answer out of protocol"}
        return {q: str(errors[k])[:500] for k, q in _ranks(errors, len(remote.agent_names))}

    def abort_probe(self, remote: RemoteEngine, reason: str) -> None:
        probe = self._probes.pop(id(remote), None)
        if probe is not None:
            with self._state:
                answered = self._answers.pop(probe.ticket, None) is not None
            if not answered:
                self.supervisor.send({"op": "abort_probe", "engine_id": remote.plan.remote_engine_id})

    # ---- reads ---------------------------------------------------------------------
    def post(self, admitted: AdmittedRead, start_s: float | None = None, *, notify: bool = True,
             deadline_in_s: float | None = None) -> InFlightRead:
        """Send an admitted read to the worker; typed errors, nothing posted, when the remote is not
        connected (or was lost with a worker) or the worker cannot take it now. ``deadline_in_s``: the
        worker ends the read itself a little after it, should the abort sent then not reach it."""
        if admitted.request.remote_digests:  # refused, not read unchecked (issue #59)
            raise UnavailableError("remote_digests", "reader workers do not check a read's digests yet: the "
                                   "daemon runs with dataplane_reader_workers; read without digests")
        with self.lock:
            current = self.remote(admitted.remote.plan.remote_engine_id)
            if current is not admitted.remote or admitted.planned is None:
                admitted = admit(current, admitted.request, admitted)
            request = admitted.request
            ticket = next(self._tickets)
            inflight = WorkerRead(admitted, {}, ReadTimes(time.perf_counter() if start_s is None else start_s),
                                  ticket=ticket)
            with self._state:
                self._reads[ticket] = inflight
            inflight.times.posted_s = time.perf_counter()
            described, fds = request_message(request)
            message = {"op": "post", "id": ticket, "engine_id": current.plan.remote_engine_id,
                       "deadline_in_s": deadline_in_s, "request": described}
            try:
                sent = inflight.generation = self.supervisor.send(message, fds)  # (0 until then: any generation's)
            finally:
                channel.close_all(fds)
            if not sent:
                with self._state:
                    self._reads.pop(ticket, None)
                raise UnavailableError("worker", "the reader worker is restarting or not reading its channel")
            return inflight

    def poll(self, inflight: InFlightRead, *, notify: bool = True) -> ReadResult | None:
        with self.lock:
            if inflight.result is None and inflight.drain is not None and time.perf_counter() > inflight.drain.until_s:
                # Aborted, and the worker never said it ended: given up on (its blocks may still be written).
                self._fail_whole(inflight, "the reader worker did not end an aborted read",
                                 inflight.failure if inflight.failure is not ReadFailure.NONE else ReadFailure.ABORTED,
                                 unsettled=True)
            if notify and inflight.result is not None:
                self.send_notices(inflight)
            return inflight.result

    def abort(self, inflight: InFlightRead, reason: str, failure: ReadFailure = ReadFailure.ABORTED, *,
              drain: bool = True) -> ReadResult | None:
        """Ask the worker to fail it; with ``drain`` its result comes from the worker (None until then),
        without it is failed here at once (the memory is about to go; the worker stops with it)."""
        with self.lock:
            if inflight.result is None:
                if inflight.failure is ReadFailure.NONE:
                    inflight.failure = failure  # what the drain's end reports, should the worker never answer
                message = {"op": "abort", "id": inflight.ticket, "reason": reason[:200], "failure": failure.value,
                           "drain": drain, "drain_s": self.abort_drain_s}
                sent_to = inflight.generation  # the generation it runs on, replaced or not
                if drain and self.supervisor.send_to(sent_to, message):
                    if inflight.drain is None:
                        inflight.drain = Drain(time.perf_counter() + self.abort_drain_s + 1.0)
                    return None
                if not drain:
                    self.supervisor.send_to(sent_to, message)
                # Not sent to a live worker (its channel full): its READ may still land: unsettled. A dead
                # worker writes nothing more.
                self._fail_whole(inflight, reason, failure, unsettled=drain and self.supervisor.current is not None)
            return self.poll(inflight, notify=True)

    def send_notices(self, inflight: InFlightRead) -> None:
        """Send the notices the worker's read made, from the engine's notice agent, once."""
        with self.lock:
            if inflight.result is None or inflight.notified:
                return
            inflight.notified = True
            notices, inflight.worker_notices = inflight.worker_notices, ()
            for agent, data in notices:
                try:
                    self.notices.notify(agent, data)
                except Exception:  # noqa: BLE001 - the holder went away: its hold expires there
                    pass
            self.num_notices_sent += 1

    def progress_notices(self) -> None:
        with self.lock:
            self.notices.poll_notifications()

    def notify_holder(self, agent_name: str, message: bytes) -> None:
        """Send one record to a holder's agent from the notice agent (a push's expectation, issue #57)."""
        with self.lock:
            self.notices.notify(agent_name, message)
            self.num_notices_sent += 1  # the data plane makes progress for the notice agent
            self.notices.poll_notifications()

    def notices_metadata(self) -> bytes:
        return self.notices.metadata()

    def close(self) -> None:
        """Stop the worker (its agent and connections go with it) and unload the holders from the notice agent."""
        self._closing = True  # the worker's end from here on is asked for, not a death
        # The engine's session, if the worker serves it, ends as the control plane's would: with why.
        ended = UnavailableError("engine_id", f"the registration of {self.cache.engine_id!r} ended")
        self.supervisor.send({"op": "session_end", "code": status_number(ended), "message": str(ended)})
        with self.lock:
            with self._state:
                remotes, self.current = list(self.current.values()), {}
            for remote in remotes:
                self._unload(remote.agent_names)
            # Stopped and joined on a thread of its own (stop() sends the stop, once it marked the worker's
            # end as asked for): the caller, the data-plane thread, is every engine's.
            threading.Thread(target=self._stop_worker, name=f"kvxferd-stop-{self.supervisor.name}", daemon=True).start()
            with self._state:
                reads = list(self._reads.values())
            for inflight in reads:
                self._fail_whole(inflight, "the engine's reads were closed", ReadFailure.ABORTED)

    def _stop_worker(self) -> None:
        self.supervisor.stop()
        self.supervisor.forget_callbacks()

    # ---- the engine's session, when this worker serves it (service/net/sessions.py) --------
    def link_ready(self, engine_id: str, ready: bool) -> None:
        """The control plane's link to ``engine_id`` turned ready or stale: the worker's session reads post
        on it, or wait for its handshake."""
        self.supervisor.send({"op": "link", "engine_id": engine_id, "ready": ready})

    def _session_event(self, generation: int, message: dict) -> None:
        """What the worker serving the session tells (the supervisor's thread). Its reads' notices are sent
        here, from the notice agent, to holders of its current connections only; the rest goes to the
        control plane's loop (``on_session``)."""
        if message["op"] == "session_notices":
            with self._state:
                holders = {name for remote in self.current.values() for name in remote.agent_names}
            pairs = [p for p in channel.notify_entries(message)[0] if p[0] in holders]
            # Not under self.lock: a handshake holds it while it waits for this thread's `connected`.
            for agent, data in pairs:  # (the notice agent has a lock of its own)
                try:
                    self.notices.notify(agent, data)
                except Exception:  # noqa: BLE001 - the holder went away: its hold expires there
                    pass
            self.num_notices_sent += 1
            return
        with self._state:
            if self.session_events_pending >= MAX_SESSION_EVENTS_PENDING:  # the loop is this far behind it
                raise InvalidArgumentError("message", f"{MAX_SESSION_EVENTS_PENDING} session events waiting: "
                                                      "the worker floods its control plane")
            self.session_events_pending += 1
        if self.on_session is not None:  # (a retiring generation's too: it serves its session to the end)
            message["generation"] = generation  # who said it (not the worker's to say)
            self.on_session(message)

    def session_event_taken(self) -> None:
        """The loop took one of the worker's session events (see MAX_SESSION_EVENTS_PENDING)."""
        with self._state:
            self.session_events_pending = max(0, self.session_events_pending - 1)

    # ---- the supervisor's thread ---------------------------------------------------------
    def _ask(self, message: dict, fds: Sequence[int] = ()) -> dict:
        """Send a command and wait for its answer (connect); typed errors for an error, a death or silence.
        One that failed is followed by a ``disconnect`` of its ``engine_id``: a late answer's connection
        would otherwise stay in the worker."""
        ticket = next(self._tickets)
        with self._state:
            self._answers[ticket] = None
        try:
            # A worker that is not up is not waited for (the next handshake tries again).
            if self.supervisor.current is None or not self.supervisor.send({**message, "id": ticket}, fds):
                raise UnavailableError("worker", "the reader worker is restarting")
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            with self._state:
                while self._answers.get(ticket) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise UnavailableError("worker", f"no answer from the reader worker in {CONNECT_TIMEOUT_S:g} s")
                    self._state.wait(left)
                answer = self._answers[ticket]
        except BaseException:
            self.supervisor.send({"op": "disconnect", "engine_id": message["engine_id"]})
            raise
        finally:
            with self._state:
                self._answers.pop(ticket, None)
        if answer["op"] == "error":
            raise TransferError("peer", f"the reader worker could not connect: {str(answer.get('message'))[:500]}")
        return answer

    def _answer(self, generation: int, message: dict) -> None:
        """An answer of the worker (its supervisor's thread): checked, then handed to whoever waits."""
        if message["op"] in SESSION_EVENTS:
            self._session_event(generation, message)
            return
        ticket = message.get("id")
        if not isinstance(ticket, int):
            raise InvalidArgumentError("id", "an answer names its command's id")
        if message["op"] != "ended":
            with self._state:
                if ticket in self._answers:
                    self._answers[ticket] = message
                    self._state.notify_all()
                    return
                inflight = self._reads.get(ticket) if message["op"] == "error" else None
            if inflight is not None:  # the worker refused a post (its connection is gone): nothing was read
                self._fail_whole(inflight, f"the reader worker refused it: {str(message.get('message'))[:500]}",
                                 ReadFailure.REMOTE_GONE)
            return
        with self._state:
            inflight = self._reads.get(ticket)
        if inflight is None:
            return  # failed here already (an abort without drain, a close)
        planned = inflight.planned
        ranks = {r.remote_rank for r in planned.reads}
        failed = tuple(sorted({q for q in _ints(message.get("failed_ranks"), max(ranks, default=0) + 1) if q in ranks}))
        failure = FAILURES.get(str(message.get("failure")), ReadFailure.TRANSFER)
        if failure is not ReadFailure.NONE and not failed:
            failed = tuple(sorted(ranks))  # a failure that names no rank: trust none of them
        if failed and failure is ReadFailure.NONE:
            failure = ReadFailure.TRANSFER
        transfer_s = message.get("transfer_s")
        if isinstance(transfer_s, (int, float)) and 0 <= transfer_s < 3600:
            inflight.times.transferred_s = inflight.times.posted_s + transfer_s
        copies = message.get("host_copies")
        inflight.copied_elsewhere = copies if isinstance(copies, int) and 0 <= copies <= len(ranks) else 0
        holders = set(inflight.remote.agent_names)
        notices = [p for p in channel.notify_entries({"notices": message.get("notices", [])})[0] if p[0] in holders]
        self._end(inflight, failed, str(message.get("error") or "")[:2000] or None,
                  failure if failed else ReadFailure.NONE, unsettled=bool(message.get("unsettled")), notices=notices)

    def _fail_whole(self, inflight: WorkerRead, error: str, failure: ReadFailure, *, unsettled: bool = False) -> None:
        """End it failed on every rank of its plan: every block it was to write is invalid."""
        self._end(inflight, tuple(r.remote_rank for r in inflight.planned.reads), error, failure, unsettled=unsettled)

    def _end(self, inflight: WorkerRead, failed: tuple[int, ...], error: str | None, failure: ReadFailure, *,
             unsettled: bool = False, notices: list[tuple[str, bytes]] = ()) -> None:
        """Its result, computed here from the ranks that failed, and the notices to send for it (any thread;
        the first to end it wins)."""
        with self._state:
            if self._reads.pop(inflight.ticket, None) is None and inflight.result is not None:
                return
            inflight.worker_notices = tuple(notices)
            planned = inflight.planned
            invalid = (planned.invalid_block_ids(failed) if failed
                       else tuple(np.zeros(0, np.int64) for _ in planned.units))
            if not inflight.times.transferred_s:
                inflight.times.transferred_s = time.perf_counter()
            inflight.failure = failure
            inflight.result = ReadResult(
                planned.request.request_id, inflight.remote.plan.remote_engine_id, not failed,
                sum(r.num_bytes for r in planned.reads if r.remote_rank not in failed),
                sum(r.num_descriptors for r in planned.reads), time.perf_counter() - inflight.times.start_s,
                invalid, failed, error if failed else None, failure, unsettled)
        self._wake()

    def _died(self, death: WorkerDeath) -> None:
        """A generation ended unasked: every read it had fails whole. The serving one: every connection is
        gone too (a re-handshake connects the next generation), and whoever waits for an answer gets an
        error; a replaced one, still serving its last reads, takes only those with it."""
        why = f"the reader worker died ({'signal %d' % -death.returncode if death.returncode < 0 else 'exit %d' % death.returncode})"
        serving = self.supervisor.serving_generation in (0, death.generation)  # (0: it was, and is gone)
        with self._state:
            reads = [r for r in self._reads.values() if r.generation in (0, death.generation)]
            for ticket, answer in self._answers.items():
                if answer is None and serving:
                    self._answers[ticket] = {"op": "error", "id": ticket, "message": why}
            self._state.notify_all()
        for inflight in reads:
            self._fail_whole(inflight, why, ReadFailure.TRANSFER)
        if serving:
            self._lose_connections(always_tell=True)
        if not self._closing:
            log.warning("%s: %d reads failed", why, len(reads))
        if self._on_death is not None and not self._closing:
            self._on_death()


def _ranks(mapping, bound: int) -> list[tuple[str, int]]:
    """The keys of a worker's ``{"rank": ...}`` that are ranks in [0, bound), with their ranks."""
    if not isinstance(mapping, dict):
        return []
    return [(k, int(k)) for k in mapping if isinstance(k, str) and k.isascii() and k.isdecimal() and int(k) < bound]


def _ints(values, bound: int) -> list[int]:
    """The ints of a worker's list within [0, bound); anything else dropped."""
    if not isinstance(values, list):
        return []
    return [v for v in values[:bound] if isinstance(v, int) and 0 <= v < bound]


def request_message(request) -> tuple[dict, list[int]]:
    """A read as a ``post`` carries it, and the fds that go with it: block ids packed (int32), local then
    remote, in hex up to INLINE_BLOB_BYTES, beyond that (a long context: one message carries about 65 000
    ids in hex) in a sealed memfd sent along (``ids_fd``; the worker reads at most MAX_IDS_BYTES of it)."""
    local, local_sizes = pack_ids(request.local_block_ids)
    remote, remote_sizes = pack_ids(request.remote_block_ids)
    fields, fds = channel.blob_fields(local + remote, "ids")
    return {"request_id": request.request_id, "remote_request_id": request.remote_request_id,
            "local_sizes": local_sizes, "remote_sizes": remote_sizes, "num_tokens": request.num_tokens or 0,
            "caps": [c.hex() for c in request.remote_capabilities], "local_bytes": len(local), **fields}, fds
