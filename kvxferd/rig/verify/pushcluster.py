"""Push (issue #57) between in-process engines: prefill ranks WRITE into the blocks decode ranks expect.

The write direction's data-plane proof, the mirror of :class:`~kvxferd.rig.verify.cluster.LocalCluster`:
every rank has its own NIXL agent over UCX on loopback. A decode rank's
expectation is a hold of its blocks on its own :class:`Holder` (board and
key), with every prefill rank introduced as a writer; each prefill rank
plans, checks the decode rank's board, WRITEs and notifies; a decode rank's
expectation ends ``CONSUMED`` once every writer it expects notified ok. Every
decode byte is then checked against the oracle, as after a read.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.groups import CacheGroup
from kvxferd.plan.push import PushRequest, expected_writers
from kvxferd.rig.reading import wait
from kvxferd.client.shm import SharedArena
from kvxferd.rig.verify.buffers import DecodeChecks, allocate_engine, shared_engine
from kvxferd.rig.verify.holderthread import HolderThread
from kvxferd.xfer.holder import Holder, Reader
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.xfer.pushes import PushExecutor
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import ReadResult

EXPECT_LEASE_S = 60.0


class PushCluster(DecodeChecks):
    """A prefill engine (TP ``prefill_tp``) pushing into a decode engine (TP ``decode_tp``).

    A :class:`ReadRequest` names both sides as for a read: ``local_block_ids``
    are the decode blocks expected, ``remote_block_ids`` the prefill hold's,
    ``remote_request_id`` the transfer id of the expectation.
    """

    def __init__(self, prefill_groups: Sequence[CacheGroup], decode_groups: Sequence[CacheGroup],
                 prefill_tp: int, decode_tp: int, *, name: str = "push", same_host: bool = False) -> None:
        """``same_host``: decode caches in named shared memory, which the prefill ranks map and copy into
        themselves (:func:`kvxferd.xfer.samehost.ranks.open_push_target`) instead of writing over NIXL."""
        self.prefill_groups, self.decode_groups = tuple(prefill_groups), tuple(decode_groups)
        self.prefill_id, self.decode_id = f"{name}-prefill", f"{name}-decode"
        self.same_host, self.arenas = same_host, []
        self.prefill = [allocate_engine(self.prefill_id, prefill_groups, prefill_tp, q, tagged=True)
                        for q in range(prefill_tp)]
        self.decode = [allocate_engine(self.decode_id, decode_groups, decode_tp, d, tagged=False,
                                       allocate=self._shared if same_host else None) for d in range(decode_tp)]
        if same_host:
            self.decode = [shared_engine(engine, arena) for engine, arena in zip(self.decode, self.arenas)]
        self.decode_agents = [NixlAgent(f"{self.decode_id}-{d}") for d in range(decode_tp)]
        for agent, engine in zip(self.decode_agents, self.decode):
            agent.register(engine.cache)
        self.expectations = [Holder(agent) for agent in self.decode_agents]
        self.readers = [ReadExecutor(NixlAgent(f"{self.prefill_id}-{q}"), e.cache) for q, e in enumerate(self.prefill)]
        self.pushers = [PushExecutor(reads) for reads in self.readers]
        for holder, engine in zip(self.expectations, self.decode):
            expected = expected_writers(engine.cache, prefill_tp)
            for q, pusher in enumerate(self.pushers):
                holder.introduce((self.prefill_id, q), Reader(pusher.notices.name, prefill_tp, expected))
        agents = self.decode_agents + [a for r in self.readers for a in (r.agent, r.notices)]
        self.holder_thread = HolderThread(agents, dict(enumerate(self.expectations))).__enter__()
        try:
            self.connect()
        except BaseException:
            self.close()
            raise

    def connect(self) -> None:
        """(Re)connect every prefill rank to the decode engine."""
        caches = [engine.cache for engine in self.decode]
        metadata = [agent.metadata() for agent in self.decode_agents]
        boards = [holder.board for holder in self.expectations]
        for pusher in self.pushers:
            pusher.connect_engine(caches, metadata, boards, same_host=self.same_host)

    def _shared(self, num_bytes: int):
        arena = SharedArena(num_bytes)
        self.arenas.append(arena)
        return arena.allocate(num_bytes)

    def expect(self, request: ReadRequest, lease_s: float = EXPECT_LEASE_S) -> tuple[bytes, ...]:
        """Every decode rank expects ``request``'s decode blocks; each rank's capability."""
        return tuple(h.hold(request.remote_request_id, request.local_block_ids, lease_s) for h in self.expectations)

    def push(self, request: ReadRequest, capabilities: Sequence[bytes], timeout_s: float = 30.0) -> list[ReadResult]:
        """Every prefill rank writes its part of ``request`` into every decode rank it notifies, then
        notifies; the results, one per (prefill rank, decode rank) pair."""
        posted = []
        for pusher in self.pushers:
            for (_, _, d), target in sorted(pusher.targets.items()):
                push = PushRequest(request.remote_request_id, request.local_block_ids, request.remote_block_ids,
                                   capabilities[d], request.num_tokens)
                posted.append((pusher, d, pusher.post(target, pusher.plan(target, d, push))))
        results = []
        for pusher, d, inflight in posted:
            results.append(wait(pusher, inflight, timeout_s))
            pusher.send_notice(inflight, d)
        return results

    def close(self) -> None:
        """Stop the thread, then drop connections and registrations (agents last)."""
        self.holder_thread.stop()
        for pusher, reads in zip(self.pushers, self.readers):
            pusher.close()
            reads.close()
        for holder, agent, engine in zip(self.expectations, self.decode_agents, self.decode):
            holder.close()
            agent.deregister(engine.cache.engine_id)
            agent.close()
        for arena in self.arenas:
            arena.close()

