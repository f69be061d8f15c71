"""Prefill and decode engines as in-process NIXL agents, one per TP rank.

The data-plane proof: every rank has its own NIXL agent over UCX on
loopback and its own host-memory arena; decode ranks connect to the
prefill engine (plan + prepared lists), post real NIXL reads, and every
decode byte is checked against the oracle. Every prefill rank answers its
readers' notices with the daemon's own :class:`Holder` (hold table and
board, reader introductions), driven by a :class:`HolderThread`, and every
read is checked against the holder's board as in the daemon.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvxferd.plan.engine import ReadRequest, expected_readers
from kvxferd.plan.groups import CacheGroup
from kvxferd.client.shm import SharedArena
from kvxferd.rig.verify.buffers import DecodeChecks, allocate_engine, shared_engine
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.holder import Holder, Reader
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import ReadResult
from kvxferd.rig.reading import post, wait


HOLD_LEASE_S = 60.0


class LocalCluster(DecodeChecks):
    """A prefill engine (TP ``prefill_tp``) and a decode engine (TP ``decode_tp``)."""

    def __init__(self, prefill_groups: Sequence[CacheGroup], decode_groups: Sequence[CacheGroup],
                 prefill_tp: int, decode_tp: int, *, name: str = "c", same_host: bool = False) -> None:
        """``same_host``: prefill caches in named shared memory, which the decode ranks map and copy from
        themselves (:mod:`kvxferd.xfer.samehost.hostmaps`) instead of reading over NIXL."""
        self.prefill_groups, self.decode_groups = tuple(prefill_groups), tuple(decode_groups)
        self.prefill_id, self.decode_id = f"{name}-prefill", f"{name}-decode"
        self.same_host, self.arenas = same_host, []
        self.prefill = [allocate_engine(self.prefill_id, prefill_groups, prefill_tp, q, tagged=True,
                                        allocate=self._shared if same_host else None) for q in range(prefill_tp)]
        if same_host:
            self.prefill = [shared_engine(engine, arena) for engine, arena in zip(self.prefill, self.arenas)]
        self.decode = [allocate_engine(self.decode_id, decode_groups, decode_tp, r, tagged=False) for r in range(decode_tp)]
        self.prefill_agents = [NixlAgent(f"{self.prefill_id}-{q}") for q in range(prefill_tp)]
        for agent, engine in zip(self.prefill_agents, self.prefill):
            agent.register(engine.cache)
        self.executors = [ReadExecutor(NixlAgent(f"{self.decode_id}-{r}"), engine.cache) for r, engine in enumerate(self.decode)]
        # Each prefill rank knows its readers as a daemon learns them at the introduction.
        self.holders = [Holder(agent) for agent in self.prefill_agents]
        self.capabilities: dict[str, tuple[bytes, ...]] = {}  # remote request id -> its last hold's, per rank
        for holder, engine in zip(self.holders, self.prefill):
            expected = expected_readers(engine.cache, decode_tp)
            for r, executor in enumerate(self.executors):
                holder.introduce((self.decode_id, r), Reader(executor.notices.name, decode_tp, expected))
        # Decode agents are polled too: their notices leave only while their notice agent makes progress.
        self.holder_thread = HolderThread(self.prefill_agents + [a for e in self.executors for a in (e.agent, e.notices)],
                                          dict(enumerate(self.holders))).__enter__()
        try:
            self.connect()
        except BaseException:
            self.close()
            raise

    def connect(self) -> None:
        """(Re)handshake every decode rank with the prefill engine."""
        caches = [engine.cache for engine in self.prefill]
        metadata = [agent.metadata() for agent in self.prefill_agents]
        boards = [holder.board for holder in self.holders]
        for executor in self.executors:
            executor.connect(caches, metadata, boards, same_host=self.same_host)

    def _shared(self, num_bytes: int):
        arena = SharedArena(num_bytes)
        self.arenas.append(arena)
        return arena.allocate(num_bytes)

    def hold(self, request: ReadRequest, lease_s: float = HOLD_LEASE_S) -> ReadRequest:
        """Hold ``request`` on every prefill rank; the request with the ranks' capabilities (also kept for
        later reads of its remote request)."""
        capabilities = tuple(holder.hold(request.remote_request_id, request.remote_block_ids, lease_s)
                             for holder in self.holders)
        self.capabilities[request.remote_request_id] = capabilities
        return dataclasses.replace(request, remote_capabilities=capabilities)

    def read(self, request: ReadRequest, timeout_s: float = 30.0, *, hold: bool = True) -> list[ReadResult]:
        """Every decode rank reads ``request``; prefill ranks hold it first."""
        if hold:
            self.hold(request)
        if not request.remote_capabilities:  # those of the last hold of its remote request, if any
            request = dataclasses.replace(request, remote_capabilities=self.capabilities.get(request.remote_request_id, ()))
        inflight = [post(executor, self.prefill_id, request) for executor in self.executors]
        return [wait(executor, f, timeout_s) for executor, f in zip(self.executors, inflight)]

    def close(self) -> None:
        """Stop the holder thread, then drop plans and registrations (agents last)."""
        self.holder_thread.stop()
        for executor in self.executors:
            executor.close()
        for holder, engine in zip(self.holders, self.prefill):
            holder.close()
            holder.agent.deregister(engine.cache.engine_id)
        for arena in self.arenas:
            arena.close()
