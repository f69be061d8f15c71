"""The rig's engine processes: a prefill and a decode engine, each with all its TP ranks, in its own OS
process beside real daemons (the demo's, and the soak's that expect their daemons to vanish).

**The demo's** (:class:`PrefillEngine`, :class:`DecodeEngine`). Each engine
is its own OS process, as beside a real daemon: it allocates its ranks'
caches in POSIX shared memory, registers them with one ``kvxferd serve`` per
rank over gRPC, and talks to nothing else. The demo driver sends it
commands over a pipe::

    driver (kvxferd demo)        prefill engine process          decode engine process
      hold(request) ──────────►  Hold on every rank's daemon
      read(request) ───────────────────────────────────────────► a Reads batch on every rank,
                                                                 wait for the completions,
                                                                 check every byte (oracle)
      events(ids)   ──────────►  CONSUMED of every rank, from
                                 the notify bus
      raw(requests) ───────────────────────────────────────────► the same reads over raw NIXL

Each runs in a :class:`kvxferd.rig.verify.process.EngineProcess` child: every
command answers ``("ok", value)`` or ``("error", message)``, so a failure in
an engine is reported, never a hang.

**The soak's** (:class:`SoakPrefill`, :class:`SoakDecode`) run in the same
children. Unlike the demo's engines they expect their
daemons to vanish, freeze and come back: every RPC has a short timeout,
a rank registers again on command, and a read reports what each rank's
daemon said (or that it said nothing) instead of raising::

    driver                    prefill engine                decode engine
      hold(id, ids, lease) ─►  Hold on every rank
      read(request, ...) ──────────────────────────────────► submit on every rank, wait,
                                                             check each rank's bytes:
                                                               ok      -> the whole rank == oracle
                                                               failed  -> right outside the named blocks
                                                               refused -> nothing written
                                                             (with the holds' digests: corrupt ->
                                                              failed, the digests named the blocks)
      register(rank) ──────►   Register again (daemon back)  (same)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from kvxferd.client import EngineClient, NotifySubscriber, SharedArena, engine_rank_pb
from kvxferd.client.engine import LostRead
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.bench.raw import RawReader, read_all
from kvxferd.rig.verify.buffers import (allocate_engine, check_buffers, check_failed_read, expected_buffers, verify_decode)
from kvxferd.rig.verify.damage import damage_held
from kvxferd.rig.verify.physical import SENTINEL


class EngineRanks:
    """Every TP rank of one engine: shared-memory caches registered with their daemons."""

    def __init__(self, engine_id: str, groups: Sequence[CacheGroup], engine_targets: Sequence[str], *,
                 tagged: bool, lease_s: float) -> None:
        self.engine_id, self.groups, self.targets = engine_id, tuple(groups), list(engine_targets)
        self.arenas: list[SharedArena] = []  # one per rank, in rank order
        self.clients: list[EngineClient | None] = [None] * len(self.targets)
        self.lease_s = lease_s
        tp_size = len(self.targets)
        try:
            self.ranks = [allocate_engine(engine_id, groups, tp_size, rank, tagged=tagged, allocate=self._allocate)
                          for rank in range(tp_size)]
            # Registration creates a NIXL agent in each daemon (about a second): all ranks at once.
            with ThreadPoolExecutor(tp_size) as pool:
                list(pool.map(self.register, range(tp_size)))
        except BaseException:
            self.close()
            raise

    def submit(self, request: ReadRequest, remote_engine_id: str, deadline_s: float, push_key: bytes = b"",
               digests: Sequence[bytes] = ()) -> None:
        """``request`` as a batch of one on every rank's session; with ``push_key``, a push's expectation of
        the transfer ``request.remote_request_id`` (issue #57) instead of a read; ``digests``: the holder
        ranks' hold digests, which every rank checks what it read against (issue #59)."""
        for client in self.clients:
            if push_key:
                spec = client.push_spec(request.request_id, remote_engine_id, request.remote_request_id, push_key,
                                        request.local_block_ids, num_tokens=request.num_tokens or 0,
                                        deadline_s=deadline_s)
            else:
                spec = client.read_spec(request.request_id, remote_engine_id, request.remote_request_id,
                                        request.local_block_ids, request.remote_block_ids,
                                        num_tokens=request.num_tokens or 0, deadline_s=deadline_s,
                                        remote_capabilities=request.remote_capabilities,
                                        remote_digests=tuple(digests))
            client.reads.submit_reads([spec])

    def _allocate(self, num_bytes: int):
        self.arenas.append(SharedArena(num_bytes))
        return self.arenas[-1].array

    def rank_pb(self, rank: int) -> pb.EngineRank:
        """The Register message of ``rank`` (its cache in its arena)."""
        return engine_rank_pb(self.ranks[rank].cache, self.arenas[rank])

    def register(self, rank: int) -> None:
        """Register ``rank`` with its daemon."""
        client = self.clients[rank] = EngineClient(self.targets[rank])  # closed even when a later rank fails
        client.register(self.rank_pb(rank), lease_s=self.lease_s)

    def close(self) -> None:
        """Deregister every rank (the daemons drop the memory), then free it."""
        for client in self.clients:
            if client is None:
                continue
            # A daemon that is gone already dropped the memory (or will, when the lease lapses).
            with contextlib.suppress(Exception):
                client.deregister()
            client.close()
        for arena in self.arenas:
            arena.close()


class PrefillEngine(EngineRanks):
    """Holds requests' blocks for readers and collects the bus events that end the holds."""

    def __init__(self, engine_id, groups, engine_targets, *, lease_s: float) -> None:
        super().__init__(engine_id, groups, engine_targets, tagged=True, lease_s=lease_s)
        self.subscribers = [NotifySubscriber(client) for client in self.clients]

    def hold(self, request: ReadRequest, want_digests: bool = False) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Hold on every rank: the ranks' capabilities, which the read must carry, and (``want_digests``)
        their digests of the held blocks, which a read may be checked against (issue #59; else b"" each)."""
        held = [client.hold(request.remote_request_id, request.remote_block_ids, lease_s=self.lease_s,
                            want_digests=want_digests) for client in self.clients]
        return tuple(h.capability for h in held), tuple(h.digests for h in held)

    def release(self, request: ReadRequest) -> None:
        """Give the blocks back without waiting for readers (the engine's answer to a failed read).

        A rank whose hold already ended (its reader finished just before the
        decode side gave up) answers NOT_FOUND: nothing left to release.
        """
        for client in self.clients:
            try:
                client.release(request.remote_request_id)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise

    def events(self, remote_request_ids: Sequence[str], released_ids: Sequence[str], timeout_s: float) -> dict:
        """Per request and rank the event that ended the hold; anything else published is counted.

        A hold ends CONSUMED; one in ``released_ids`` (its read failed and
        the engine released it) ends EXPIRED, or CONSUMED when its reader
        finished first; FAILED events may precede.
        """
        consumed, missing, other = 0, [], []
        for request_id in remote_request_ids:
            released = request_id in released_ids
            for rank, subscriber in enumerate(self.subscribers):
                event = subscriber.wait_for(request_id, timeout_s=timeout_s)
                if event is None:
                    missing.append(f"{request_id} rank {rank}: no {'EXPIRED' if released else 'CONSUMED'}")
                elif event.kind == pb.NotifyEvent.CONSUMED:
                    consumed += 1
                elif not released:  # a released hold may end EXPIRED: the release ended it
                    other.append(f"{request_id} rank {rank}: {pb.NotifyEvent.Kind.Name(event.kind)} ({event.reason})")
                other += [f"{request_id} rank {rank}: also {pb.NotifyEvent.Kind.Name(e.kind)} ({e.reason})"
                          for e in subscriber.events_of(request_id)
                          if not (released and e.kind == pb.NotifyEvent.FAILED)]
        for rank, subscriber in enumerate(self.subscribers):  # a quiet bus now: nothing more may come
            while (event := subscriber.next(timeout_s=0.05)) is not None:
                if not (event.request_id in released_ids and event.kind == pb.NotifyEvent.FAILED):
                    other.append(f"{event.request_id} rank {rank}: stray {pb.NotifyEvent.Kind.Name(event.kind)}")
        return {"consumed": consumed, "missing": missing, "other": other}

    def close(self) -> None:
        for subscriber in getattr(self, "subscribers", ()):
            subscriber.close()
        super().close()


class DecodeEngine(EngineRanks):
    """Reads requests through its daemons and checks every byte against the oracle."""

    def __init__(self, engine_id, groups, engine_targets, *, lease_s: float,
                 tls_files: tuple[str, str, str] | None = None) -> None:
        """``tls_files``: ``(ca, cert, key)`` PEM paths the raw baseline dials the prefill daemons with
        (their peer ports run mutual TLS)."""
        super().__init__(engine_id, groups, engine_targets, tagged=False, lease_s=lease_s)
        self.tls_files = tls_files

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls_files is None:
            return None
        ca, cert, key = (open(path, "rb").read() for path in self.tls_files)
        return grpc.ssl_channel_credentials(ca, key, cert)

    def handshake(self, remote_engine_id: str, peer_addresses: Sequence[str]) -> None:
        for client in self.clients:
            client.handshake(remote_engine_id, peer_addresses)

    def read(self, request: ReadRequest, remote_engine_id: str, prefill_groups: Sequence[CacheGroup],
             timeout_s: float, digests: Sequence[bytes] = ()) -> dict:
        """One request on every rank (checked by the daemons against the holders' ``digests`` when given):
        submit, wait for completions, verify; the figures as a dict."""
        for engine in self.ranks:
            engine.reset()
        start, submitted_unix_s = time.perf_counter(), time.time()
        self.submit(request, remote_engine_id, timeout_s, digests=digests)
        delivered = [client.reads.wait_completion_timed(request.request_id, timeout_s + 5) for client in self.clients]
        latency_s = time.perf_counter() - start
        completions = [completion for completion, _ in delivered]
        ok = all(c.ok for c in completions)
        # A failed read leaves its blocks undefined: the engine must not use them, nor do we check them.
        problems, wrong = verify_decode(self.ranks, prefill_groups, request) if ok else ([], 0)
        return {"ok": ok, "latency_s": latency_s,
                "errors": [f"rank {r}: {c.error}" for r, c in enumerate(completions) if not c.ok],
                "bytes": sum(c.num_bytes for c in completions),
                "descriptors": sum(c.num_descriptors for c in completions),
                "post_s": max(c.post_s for c in completions),
                "stages_s": read_stages(submitted_unix_s, delivered) if ok else {},
                "verified_bytes": sum(engine.num_bytes for engine in self.ranks) if ok else 0,
                "mismatched_bytes": wrong, "mismatches": problems}

    def raw(self, requests: Sequence[ReadRequest], remote_engine_id: str, peer_addresses: Sequence[str]) -> dict:
        """The same reads over raw NIXL (no daemon in the path); per request, all ranks at once."""
        credentials = self._credentials()
        readers = [RawReader(engine.cache, remote_engine_id, list(peer_addresses), f"raw-{self.engine_id}-{r}",
                             credentials) for r, engine in enumerate(self.ranks)]
        try:
            seconds, num_bytes = [], 0
            warm_up_s = _warm_up(readers, requests[0])
            for request in requests:
                took_s, request_bytes = _read_round(readers, request)
                seconds.append(took_s)
                num_bytes += request_bytes
            return {"seconds": seconds, "bytes": num_bytes, "warm_up_s": warm_up_s}
        finally:
            for reader in readers:
                reader.close()


def read_stages(submitted_unix_s: float, delivered: Sequence[tuple[pb.Completion, float]]) -> dict[str, float]:
    """Where one request's time went, on the decode rank whose completion came last (it sets the latency).

    Wall clocks of the engine and its daemon (one host): submitted -> the daemon
    took the read -> planned -> every rank posted (``transfer()`` copies host
    memory synchronously, so the copy is here) -> transfers ended -> board checks in
    -> the engine has the completion.
    """
    completion, delivered_unix_s = max(delivered, key=lambda item: item[1])
    started_unix_s = completion.done_unix_s - completion.duration_s
    return {"to_daemon": started_unix_s - submitted_unix_s, "plan": completion.plan_s,
            "post": completion.post_s - completion.plan_s, "transfer": completion.transfer_s,
            "check": completion.check_s, "to_engine": delivered_unix_s - completion.done_unix_s}


# Opening a UCX connection needs its owner to make progress, and a prefill daemon that holds
# nothing polls its agents every 0.5 s (IDLE_POLL_S). The first read to a new peer took 0.5-1.5 s,
# and the next one sometimes another 0.5 s (2 of 20 presets): a timed read that paid for that made
# the row's raw GB/s a hundredth of the usual. So the warm-up repeats until a round is fast.
WARM_UP_FAST_S = 0.05  # raw reads of a demo request take 1-5 ms here; a connection's wait, ~0.5 s
MAX_WARM_UP_ROUNDS = 8


def _warm_up(readers: Sequence[RawReader], request: ReadRequest) -> list[float]:
    """Read ``request`` until a round after the first takes under WARM_UP_FAST_S; each round's seconds."""
    rounds_s: list[float] = []
    while len(rounds_s) < MAX_WARM_UP_ROUNDS and (len(rounds_s) < 2 or rounds_s[-1] >= WARM_UP_FAST_S):
        rounds_s.append(_read_round(readers, request)[0])
    return rounds_s


def _read_round(readers: Sequence[RawReader], request: ReadRequest) -> tuple[float, int]:
    """One request on every rank over raw NIXL: ``(seconds, bytes)``; lists are prepared before the clock starts.

    The decode ranks read in parallel through their daemons; here one process
    posts every rank's transfers before polling any, then polls them together.
    """
    prepared = [reader.prepare(request) for reader in readers]
    try:
        took_s = read_all([t for reader, rank in zip(readers, prepared) for t in reader.transfers(rank)])
    finally:
        for reader, rank in zip(readers, prepared):
            reader.release(rank)
    return took_s, sum(p[3] for rank in prepared for p in rank)


RPC_TIMEOUT_S = 2.0  # a frozen daemon must not stall the engine for longer
REGISTER_WAIT_S = 30.0  # a restarted engine waits until its old session's lease ran out


class SoakRanks(EngineRanks):
    """The demo's engine ranks, with short RPC timeouts and registration that retries and can be redone."""

    def arena_names(self) -> list[str]:
        """The shared-memory objects of this engine (the driver removes them if it kills the engine)."""
        return [arena.name for arena in self.arenas]

    def register(self, rank: int) -> float:
        """(Re-)register ``rank``; retries while its daemon starts or an old session lingers. Seconds it took."""
        start = time.monotonic()
        old = self.clients[rank]
        if old is not None:
            try:  # its own session may replace what it has (or its heartbeat already registered again)
                old.register(self.rank_pb(rank), lease_s=self.lease_s)
                return time.monotonic() - start
            except grpc.RpcError:
                old.close()
        while True:
            # Register alone waits longer: one that timed out would still register, and the retry would
            # be refused (that session unknown) until its lease ran out.
            client = EngineClient(self.targets[rank], timeout_s=RPC_TIMEOUT_S, register_timeout_s=REGISTER_WAIT_S)
            try:
                client.register(self.rank_pb(rank), lease_s=self.lease_s)
                self.clients[rank] = client
                return time.monotonic() - start
            except grpc.RpcError:
                client.close()
                if time.monotonic() - start > REGISTER_WAIT_S:
                    raise
                time.sleep(0.1)


class SoakPrefill(SoakRanks):
    """Holds blocks for readers on every rank; tagged caches."""

    def __init__(self, engine_id, groups, engine_targets, *, lease_s: float) -> None:
        super().__init__(engine_id, groups, engine_targets, tagged=True, lease_s=lease_s)

    def hold(self, request_id: str, block_ids, lease_s: float, push_key_digest: bytes = b"",
             by_layer: bool = False, want_digests: bool = False) -> list[tuple[str, bytes, bytes]]:
        """Hold on every rank (a push's with its key's digest); per rank ("ok", its capability, its digests:
        b"" unless ``want_digests``), or (the status code name of a failed call, b"", b""). ``by_layer``: a
        push held with no layer final, then every layer said final in turn, one FinalLayers per layer and
        rank (issue #57)."""
        held: dict[int, tuple[bytes, bytes]] = {}
        layer_counts = self.ranks[0].cache.layer_counts
        first = [0] * len(layer_counts) if by_layer else ()

        def hold_on(rank: int, client) -> None:
            answer = client.hold(request_id, block_ids, lease_s=lease_s, push_key_digest=push_key_digest,
                                 layers_final=first, want_digests=want_digests)
            held[rank] = answer.capability, answer.digests

        answers = [_call(lambda r=rank, c=client: hold_on(r, c)) for rank, client in enumerate(self.clients)]
        for layer in range(1, max(layer_counts) + 1) if by_layer else ():
            counts = [min(layer, n) for n in layer_counts]
            for rank, client in enumerate(self.clients):
                if answers[rank] == "ok":
                    _call(lambda c=client: c.final_layers(request_id, counts))
        return [(answer, *held.get(rank, (b"", b""))) for rank, answer in enumerate(answers)]

    def release(self, request_id: str) -> list[str]:
        """Give the blocks back on every rank (what an engine does when the read failed)."""
        return [_call(lambda c=client: c.release(request_id)) for client in self.clients]

    def damage(self, block_ids, num_tokens: int | None, how: str, seed: int) -> int:
        """Damage a request's last token in its held blocks on every rank after its hold
        (kvxferd.rig.verify.damage: ``flip`` a bit, or ``write`` as an engine reusing the block would); bytes
        changed. :meth:`undo` puts them back."""
        rng = np.random.default_rng(seed)
        self._damage = [(engine, damage_held(engine, block_ids, how, rng, num_tokens)) for engine in self.ranks]
        return sum(len(old) for _, damage in self._damage for *_, old in damage.changes)

    def undo(self) -> None:
        """The last :meth:`damage` undone (the next request holding those blocks holds the right bytes)."""
        for engine, damage in getattr(self, "_damage", ()):
            damage.undo(engine)
        self._damage = []


def _call(call) -> str:
    try:
        call()
        return "ok"
    except grpc.RpcError as err:
        return err.code().name


class SoakDecode(SoakRanks):
    """Reads through its daemons and checks every rank's bytes against the oracle."""

    def __init__(self, engine_id, groups, engine_targets, *, lease_s: float) -> None:
        super().__init__(engine_id, groups, engine_targets, tagged=False, lease_s=lease_s)

    def handshake(self, remote_engine_id: str, peer_addresses: Sequence[str], ranks: Sequence[int] | None = None,
                  wait_s: float = 20.0) -> list[str]:
        """Handshake ``ranks`` (default all) with the prefill engine; retries while peers come back."""
        outcome = []
        for rank in range(len(self.clients)) if ranks is None else ranks:
            deadline = time.monotonic() + wait_s
            while (result := _call(lambda: self.clients[rank].handshake(remote_engine_id, peer_addresses))) != "ok" \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            outcome.append(result)
        return outcome

    def read(self, request: ReadRequest, remote_engine_id: str, prefill_groups: Sequence[CacheGroup],
             deadline_s: float, wait_s: float, push_key: bytes = b"", digests: Sequence[bytes] = ()) -> dict:
        """One request on every rank (a push's expectation with ``push_key``; checked against the holders'
        ``digests`` when given); per rank its outcome, latency and any broken invariant.

        ``wait_s``: how long to wait for each completion before calling it
        missing. A rank whose stream broke (its daemon died) is ``lost``:
        the engine treats every block as invalid, as it must.
        """
        for engine in self.ranks:
            engine.reset()
        start, start_wall = time.monotonic(), time.time()
        self.submit(request, remote_engine_id, deadline_s, push_key, digests)
        ranks = []
        for rank, client in enumerate(self.clients):
            try:
                completion, arrived = client.reads.wait_completion_timed(request.request_id,
                                                                   max(0.0, start + wait_s - time.monotonic()))
            except TimeoutError as err:
                lost = isinstance(err, LostRead) or client.reads.stream_error is not None
                outcome = "lost" if lost else "missing"
                # Why, for a post-mortem: the stream's status, or a registration replaced under the read.
                why = f"{type(err).__name__}: {err}"
                if client.reads.stream_error is not None:
                    why += f" [stream {client.reads.stream_error.code().name}: {client.reads.stream_error.details()}]"
                why += f" [re-registrations so far: {client.num_reregistrations}]"
                ranks.append({"outcome": outcome, "latency_s": time.monotonic() - start, "problems": [],
                              "verified_bytes": 0, "error": why})
                continue
            # When it reached this engine, not when this loop got to it (an earlier rank may have been slow).
            ranks.append(self._check(rank, completion, arrived - start_wall, prefill_groups, request))
        return {"ranks": ranks}

    def _check(self, rank: int, completion, latency_s: float, prefill_groups, request: ReadRequest) -> dict:
        engine = self.ranks[rank]
        if completion.ok:
            problems = check_buffers(engine, expected_buffers(engine.cache, prefill_groups, request))
            outcome, verified = "ok", engine.num_bytes
        elif completion.refused_code:  # refused before anything was posted: nothing may be written
            untouched = engine.gaps_intact() and all(np.all(buf == SENTINEL) for group in engine.buffers
                                                     for buf in group)
            problems = [] if untouched else [f"{engine.cache.engine_id} rank {rank}: a refused read wrote bytes"]
            outcome, verified = "refused", 0
        else:  # (corrupt: its blocks differ from the holders' digests, those named invalid)
            invalid = [list(ids.ids) for ids in completion.invalid_block_ids]
            problems = check_failed_read(engine, prefill_groups, request, invalid)
            outcome, verified = "corrupt" if completion.failure == "corrupt" else "failed", 0
        return {"outcome": outcome, "latency_s": latency_s,
                "problems": [f"{request.request_id}: {p}" for p in problems],
                "verified_bytes": verified, "error": completion.error}
