"""The raw-NIXL baseline the benchmarks compare against: the plan's descriptors, nothing else."""

from __future__ import annotations

import time

import grpc
import numpy as np

from kvxferd.plan.descriptors import expand_rows
from kvxferd.plan.engine import EngineTransferPlan, RankPlan, RankRead, ReadRequest
from kvxferd.plan.groups import EngineCache
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION, decode_info
from kvxferd.xfer.nixl.agent import NixlAgent


def prepare_raw(raw_agent, remote_agent_name: str, rank_plan: RankPlan, read: RankRead, *,
                mem_types: tuple[str, str] = ("DRAM", "DRAM")) -> tuple[object, object, np.ndarray]:
    """Descriptor lists holding exactly ``read``'s descriptors, and the ids that select all of them.

    ``mem_types``: (local, remote) NIXL memory types, "VRAM" for GPU caches.
    """
    descs = []
    for rows, ids in ((rank_plan.local_rows, read.local_ids), (rank_plan.remote_rows, read.remote_ids)):
        addresses, lengths = expand_rows(rows)
        descs.append(np.stack([addresses[ids], lengths[ids], np.zeros(len(ids), np.int64)], axis=1).astype(np.uint64))
    local = raw_agent.prep_xfer_dlist("", descs[0], mem_types[0])
    remote = raw_agent.prep_xfer_dlist(remote_agent_name, descs[1], mem_types[1])
    return local, remote, np.arange(len(read.local_ids), dtype=np.int32)


def read_all(transfers, notification: bytes = b"", op: str = "READ") -> float:
    """Post every ``(raw_agent, local list, remote list, ids)`` READ (or ``op`` WRITE) before polling any;
    seconds until all are done.

    make_prepped_xfer + transfer + poll, straight on nixl: the baseline.
    """
    start = time.perf_counter()
    handles = [(agent, agent.make_prepped_xfer(op, local, ids, remote, ids, notification))
               for agent, local, remote, ids in transfers]
    states = [agent.transfer(handle) for agent, handle in handles]
    while "PROC" in states:
        states = [state if state != "PROC" else agent.check_xfer_state(handle)
                  for (agent, handle), state in zip(handles, states)]
    elapsed = time.perf_counter() - start
    for _, handle in handles:
        handle.release()
    if any(state != "DONE" for state in states):
        raise RuntimeError(f"raw NIXL transfer ended {states}")
    return elapsed


def raw_read(raw_agent, local_list, remote_list, ids: np.ndarray, notification: bytes = b"") -> None:
    """One raw READ, posted and polled to the end."""
    read_all([(raw_agent, local_list, remote_list, ids)], notification)


def fetch_peer_info(address: str, remote_engine_id: str, tp_rank: int, local: EngineCache, reader: NixlAgent,
                    credentials: grpc.ChannelCredentials | None = None):
    """One prefill rank's engine info from its daemon's peer service, ``reader`` introduced as a reader of ``local``'s TP.

    ``credentials``: a client certificate when the daemons run mutual TLS.
    """
    channel = (grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "kvxferd-peer")])
               if credentials is not None else peer_channel(address))
    with channel:
        reply = peer_grpc.PeerServiceStub(channel).GetEngineInfo(
            pb.EngineInfoRequest(engine_id=remote_engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=tp_rank,
                                 reader_engine_id=reader.name, reader_tp_rank=local.tp_rank,
                                 reader_tp_size=local.tp_size, reader_agent_metadata=reader.metadata()),
            timeout=30)
    return decode_info(reply, local)


class RawReader:
    """Raw NIXL into one decode rank's cache, reading the prefill daemons' agents directly.

    Cross-process like the daemon path (same memory, same transport, the
    plan's descriptors): only the daemons' control plane is missing.
    Descriptor lists are prepared per request before the clock starts.
    """

    def __init__(self, local: EngineCache, remote_engine_id: str, peer_addresses: list[str], agent_name: str,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.local = local
        self.agent = NixlAgent(agent_name)
        self.agent.register(local)
        infos = [fetch_peer_info(a, remote_engine_id, q, local, self.agent, credentials)
                 for q, a in enumerate(peer_addresses)]
        self.remote_names = [self.agent.add_remote(info.agent_metadata) for info in infos]
        self.remote_mem_types = [info.cache.mem_type for info in infos]
        self.plan = EngineTransferPlan(local, [info.cache for info in infos])
        self._rank_plans = {rank_plan.remote_rank: rank_plan for rank_plan in self.plan.rank_plans}

    def prepare(self, request: ReadRequest) -> list[tuple[object, object, np.ndarray, int]]:
        """``(local list, remote list, ids, bytes)`` per remote rank this request reads from."""
        return [(*prepare_raw(self.agent.raw, self.remote_names[read.remote_rank], self._rank_plans[read.remote_rank],
                              read, mem_types=(self.local.mem_type, self.remote_mem_types[read.remote_rank])),
                 read.num_bytes)
                for read in self.plan.plan_request(request).reads]

    def transfers(self, prepared: list[tuple[object, object, np.ndarray, int]]) -> list[tuple]:
        """``prepared`` as :func:`read_all` takes it."""
        return [(self.agent.raw, local, remote, ids) for local, remote, ids, _ in prepared]

    def read(self, prepared: list[tuple[object, object, np.ndarray, int]], op: str = "READ") -> float:
        """Post one transfer per remote rank, poll them all; returns the seconds it took. ``op="WRITE"``: the
        same descriptors written into the remote's (the push baseline: local is then the prefill cache)."""
        return read_all(self.transfers(prepared), op=op)

    @staticmethod
    def release(prepared: list[tuple[object, object, np.ndarray, int]]) -> None:
        for local, remote, _, _ in prepared:
            local.release()
            remote.release()

    def close(self) -> None:
        self.agent.deregister(self.local.engine_id)
