"""Malformed input on every RPC, against real daemons: never UNKNOWN or INTERNAL, always answered in time.

Each case starts from a valid message of its RPC (so deep paths are
reached) and overwrites a few fields, chosen at random over the message
tree, with hostile values: non-printable or huge strings, negative and
huge integers, NaN and infinities, truncated or random bytes, long
repeated fields. Seeded: a failure prints its seed and case.
"""

from __future__ import annotations

import math
import random

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxferd.verify.daemons import DaemonCluster
from kvxferd.verify.models import ModelShape, model_groups, random_request
from tests.service.helpers import engine_pb
from tests.service.test_protocol_defects import ANSWER_S, engine_info, read_still_works

GROUPS = model_groups("gqa", ModelShape())
NUM_CASES = 60  # per RPC
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)
# Handshakes dial what they are given: only loopback literals and unparsable targets, never a DNS name.
ADDRESSES = ["127.0.0.1:1", "127.0.0.1:0", "[::1]:1", "127.0.0.1:99999", "127.0.0.1:", ":1", "unix:/nonexistent"]


def hostile_string(rng: random.Random) -> str:
    return rng.choice(["", "\0", "a\0b", "\ud800"[:0] + "\x7f", "é" * 200, "x" * 300, "../..", " ", "\n", "ghost",
                       "/", "//", "/..", "%s%n", "a" * rng.randint(1, 2000)])


def hostile_value(field, rng: random.Random, current):
    t = field.type
    if t == F.TYPE_STRING:
        return rng.choice(ADDRESSES) if field.name == "peer_addresses" else hostile_string(rng)
    if t == F.TYPE_BYTES:
        if current and rng.random() < 0.6:  # damage the valid bytes: one flipped byte, or cut short
            data = bytearray(current)
            if rng.random() < 0.5:
                data[rng.randrange(len(data))] = rng.choice([0x00, 0xD8, 0xFF, rng.getrandbits(8)])
                return bytes(data)
            return bytes(data[: rng.randrange(len(data))])
        return rng.choice([b"", b"\0" * 64, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
                           b"nixlSerDes|Agent" + bytes(8), b"nixlSerDes|Agent\xff\xff\xff\xff\xff\xff\xff\x7f"])
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, 5e-324, 1e9])
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (F.TYPE_UINT64, F.TYPE_UINT32, F.TYPE_FIXED64, F.TYPE_FIXED32):
        bits = 64 if t in (F.TYPE_UINT64, F.TYPE_FIXED64) else 32
        return rng.choice([0, 1, 2**bits - 1, rng.getrandbits(bits)])
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    bits = 64 if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64) else 32
    return rng.choice([0, -1, 1, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, rng.randint(-1000, 1000), 7])


def leaves(message) -> list[tuple[object, object]]:
    """Every (message, scalar field) of the populated tree, and every repeated message field."""
    out = []
    for field in message.DESCRIPTOR.fields:
        if field.type != F.TYPE_MESSAGE:
            out.append((message, field))
        elif field.is_repeated:
            out.append((message, field))
            for item in getattr(message, field.name):
                out += leaves(item)
        elif message.HasField(field.name):
            out += leaves(getattr(message, field.name))
        else:
            out.append((message, field))
    return out


def mutate(message, rng: random.Random) -> None:
    """Overwrite one leaf of ``message``, chosen uniformly over its populated tree."""
    parent, field = rng.choice(leaves(message))
    if field.type == F.TYPE_MESSAGE:
        if field.is_repeated:  # drop the list, or add an empty element
            items = getattr(parent, field.name)
            if rng.random() < 0.5:
                del items[:]
            else:
                items.add()
        else:
            getattr(parent, field.name).SetInParent()  # an empty sub-message
        return
    if field.is_repeated:
        items = getattr(parent, field.name)
        del items[:]
        items.extend(hostile_value(field, rng, None) for _ in range(rng.choice([0, 1, 2, 3, 50, 20_000])))
        return
    setattr(parent, field.name, hostile_value(field, rng, getattr(parent, field.name)))


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="fz") as c:
        yield c


def base_messages(cluster: DaemonCluster, arenas: list) -> dict[str, tuple[str, object]]:
    """RPC name -> (service, a valid message), for engine ids that fuzzing may break."""
    request = random_request("fuzz", *GROUPS, 48, np.random.default_rng(0))
    engine_id = cluster.decode_id
    reader = engine_info(cluster, "decode")
    ids = lambda lists: [pb.BlockIds(ids=[int(i) for i in x]) for x in lists]  # noqa: E731
    return {
        "Register": ("engine", pb.RegisterRequest(engine=engine_pb(GROUPS[1], "fuzzed", arenas), lease_s=5)),
        "Heartbeat": ("engine", pb.HeartbeatRequest(engine_id=engine_id)),
        "Deregister": ("engine", pb.DeregisterRequest(engine_id="fuzzed")),
        "Handshake": ("engine", pb.HandshakeRequest(engine_id=engine_id, remote_engine_id="ghost",
                                                    peer_addresses=["127.0.0.1:1"])),
        "SubmitRead": ("engine", pb.SubmitReadRequest(
            engine_id=engine_id, request_id="fz", remote_engine_id=cluster.prefill_id, remote_request_id="fz",
            local_block_ids=ids(request.local_block_ids), remote_block_ids=ids(request.remote_block_ids),
            deadline_s=2)),
        "WatchCompletions": ("engine", pb.WatchCompletionsRequest(engine_id="fuzzed")),
        "Hold": ("prefill", pb.HoldRequest(engine_id=cluster.prefill_id, request_id="fz",
                                           block_ids=ids(request.remote_block_ids), lease_s=1)),
        "RenewLease": ("prefill", pb.RenewLeaseRequest(engine_id=cluster.prefill_id, request_ids=["fz"], lease_s=1)),
        "Release": ("prefill", pb.ReleaseRequest(engine_id=cluster.prefill_id, request_id="fz")),
        "MissedEvents": ("prefill", pb.MissedEventsRequest(engine_id=cluster.prefill_id, after_seq=0)),
        "GetEngineInfo": ("peer", pb.EngineInfoRequest(
            engine_id=cluster.prefill_id, protocol_version=1, tp_rank=0, reader_engine_id="fz-reader",
            reader_tp_rank=0, reader_agent_metadata=reader.agent_metadata)),
        "GetIncarnation": ("peer", pb.IncarnationRequest(engine_id=cluster.prefill_id)),
        "RenewLeases": ("peer", pb.RenewLeaseRequest(engine_id=cluster.prefill_id, request_ids=["fz"], lease_s=1)),
    }


def call(stubs, service: str, method: str, message):
    stub = stubs[service]
    if method == "WatchCompletions":
        for _ in getattr(stub, method)(message, timeout=ANSWER_S):
            break
        return
    getattr(stub, method)(message, timeout=ANSWER_S)


@pytest.mark.parametrize("method", ["Register", "Heartbeat", "Deregister", "Handshake", "SubmitRead",
                                    "WatchCompletions", "Hold", "RenewLease", "Release", "MissedEvents",
                                    "GetEngineInfo", "GetIncarnation", "RenewLeases"])
def test_malformed_input_gets_a_precise_status_in_time(cluster, method):
    arenas: list = []
    channels = {"engine": grpc.insecure_channel(cluster.decode_daemons[0].engine_target),
                "prefill": grpc.insecure_channel(cluster.prefill_daemons[0].engine_target),
                "peer": grpc.insecure_channel(cluster.prefill_daemons[0].peer_address)}
    stubs = {"engine": pb_grpc.EngineServiceStub(channels["engine"]),
             "prefill": pb_grpc.EngineServiceStub(channels["prefill"]), "peer": pb_grpc.PeerServiceStub(channels["peer"])}
    try:
        service, base = base_messages(cluster, arenas)[method]
        seen: dict[str, int] = {}
        for case in range(NUM_CASES):
            rng = random.Random(f"{method}-{case}")
            message = type(base)()
            message.CopyFrom(base)
            for _ in range(rng.randint(1, 3)):
                mutate(message, rng)
            if method == "WatchCompletions" and message.engine_id in (cluster.decode_id, cluster.prefill_id):
                continue  # would replace the cluster's own stream (by design)
            try:
                call(stubs, service, method, message)
                seen["OK"] = seen.get("OK", 0) + 1
            except grpc.RpcError as err:
                assert err.code() not in FORBIDDEN, f"{method} case {case}: {err.code().name}: {err.details()}\n{message}"
                seen[err.code().name] = seen.get(err.code().name, 0) + 1
        assert sum(n for code, n in seen.items() if code != "OK") >= NUM_CASES // 4, seen  # most cases were bad input
    finally:
        for channel in channels.values():
            channel.close()
        for arena in arenas:
            arena.close()
    stubs_ok = cluster.decode_clients[0].stub  # the cluster's own registrations survived
    stubs_ok.Heartbeat(pb.HeartbeatRequest(engine_id=cluster.decode_id), timeout=ANSWER_S)
    cluster.prefill_clients[0].release("fz") if _held(cluster, "fz") else None
    read_still_works(cluster, f"after-{method}", seed=len(method))


def _held(cluster: DaemonCluster, request_id: str) -> bool:
    unknown = cluster.prefill_clients[0].renew([request_id], lease_s=1)
    return not unknown
