"""Helpers shared by the tests that drive real daemons."""

from __future__ import annotations

import grpc
import pytest

from kvxferd.client import SharedArena, engine_rank_pb
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.verify.engines import allocate_engine


def engine_pb(groups, engine_id: str = "other", arenas: list | None = None) -> pb.EngineRank:
    """A Register message for a one-rank engine whose cache lies in a new shared arena (appended to ``arenas``)."""
    holder: list[SharedArena] = []

    def allocate(num_bytes):
        holder.append(SharedArena(num_bytes))
        return holder[-1].array

    engine = allocate_engine(engine_id, groups, 1, 0, tagged=False, allocate=allocate)
    if arenas is not None:
        arenas.extend(holder)
    return engine_rank_pb(engine.cache, holder[0])


def status(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call that must fail."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()
