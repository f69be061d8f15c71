"""The soak's engines: a prefill and a decode engine, each its own OS process so it can be killed.

They run in :class:`kvxferd.rig.verify.process.EngineProcess` children and take
commands over its pipe. Unlike the demo's engines they expect their
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
      register(rank) ──────►   Register again (daemon back)  (same)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvxferd.client import EngineClient
from kvxferd.client.engine import LostRead
from kvxferd.rig.demo.engines import EngineRanks
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.rig.verify.engines import check_buffers, check_failed_read, expected_buffers
from kvxferd.rig.verify.physical import SENTINEL

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
            client = EngineClient(self.targets[rank], timeout_s=RPC_TIMEOUT_S)
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

    def hold(self, request_id: str, block_ids, lease_s: float) -> list[tuple[str, bytes]]:
        """Hold on every rank; per rank ("ok", its capability), or (the status code name of a failed call, b"")."""
        held: dict[int, bytes] = {}

        def hold_on(rank: int, client) -> None:
            held[rank] = client.hold(request_id, block_ids, lease_s=lease_s).capability

        answers = [_call(lambda r=rank, c=client: hold_on(r, c)) for rank, client in enumerate(self.clients)]
        return [(answer, held.get(rank, b"")) for rank, answer in enumerate(answers)]

    def release(self, request_id: str) -> list[str]:
        """Give the blocks back on every rank (what an engine does when the read failed)."""
        return [_call(lambda c=client: c.release(request_id)) for client in self.clients]


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
             deadline_s: float, wait_s: float) -> dict:
        """One request on every rank; per rank its outcome, latency and any broken invariant.

        ``wait_s``: how long to wait for each completion before calling it
        missing. A rank whose stream broke (its daemon died) is ``lost``:
        the engine treats every block as invalid, as it must.
        """
        for engine in self.ranks:
            engine.reset()
        start, start_wall = time.monotonic(), time.time()
        for client in self.clients:
            client.reads.submit_reads([client.read_spec(request.request_id, remote_engine_id, request.remote_request_id,
                                                  request.local_block_ids, request.remote_block_ids,
                                                  num_tokens=request.num_tokens or 0, deadline_s=deadline_s,
                                                  remote_capabilities=request.remote_capabilities)])
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
        else:
            invalid = [list(ids.ids) for ids in completion.invalid_block_ids]
            problems = check_failed_read(engine, prefill_groups, request, invalid)
            outcome, verified = "failed", 0
        return {"outcome": outcome, "latency_s": latency_s,
                "problems": [f"{request.request_id}: {p}" for p in problems],
                "verified_bytes": verified, "error": completion.error}
