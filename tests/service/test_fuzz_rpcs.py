"""Malformed input on every RPC, against real daemons: never UNKNOWN or INTERNAL, always answered in time.

Hypothesis drives it from the protos' own field descriptors: each example
starts from a valid message of its RPC (so deep paths are reached, with
the engine's real session attached) and overwrites one to three leaves,
chosen over the populated message tree, with values drawn for the field's
type: hostile or random strings, negative and huge integers, NaN and
infinities, damaged or random bytes, long repeated fields. 160 examples
per RPC, 2,240 in all (14 RPCs, the Reads stream included), in the default
run; after each RPC's batch a byte-exact transfer still works on the
existing link.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.wire.peerauth import peer_channel
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from tests.service.helpers import engine_pb
from tests.service.test_protocol_defects import ANSWER_S, engine_info, read_still_works

GROUPS = model_groups("gqa", ModelShape())
EXAMPLES_PER_RPC = 160  # x 14 RPCs = 2,240
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)
# Handshakes dial what they are given: only loopback literals and unparsable targets, never a DNS name.
ADDRESSES = ["127.0.0.1:1", "127.0.0.1:0", "[::1]:1", "127.0.0.1:99999", "127.0.0.1:", ":1", "unix:/nonexistent"]
HOSTILE_STRINGS = ["", "\0", "a\0b", "\x7f", "é" * 200, "x" * 300, "../..", " ", "\n", "ghost", "/", "//", "/..",
                   "%s%n", "a" * 2000]
REPEATS = [0, 1, 2, 3, 50, 20_000]


def value_strategy(field, current):
    """Values for one scalar field, from its descriptor type."""
    t = field.type
    if t == F.TYPE_STRING:
        if field.name == "peer_addresses":
            return st.sampled_from(ADDRESSES)
        return st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=300))
    if t == F.TYPE_BYTES:
        options = [st.sampled_from([b"", b"\0" * 64, b"nixlSerDes|Agent" + bytes(8),
                                    b"nixlSerDes|Agent\xff\xff\xff\xff\xff\xff\xff\x7f"]), st.binary(max_size=300)]
        if current:  # damage the valid bytes: one byte changed, or cut short
            options += [st.builds(lambda i, b: current[:i] + bytes([b]) + current[i + 1:],
                                  st.integers(0, len(current) - 1), st.integers(0, 255)),
                        st.integers(0, len(current) - 1).map(lambda i: current[:i])]
        return st.one_of(options)
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, 5e-324, 1e9]),
                         st.floats(allow_nan=True, allow_infinity=True))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    unsigned = t in (F.TYPE_UINT64, F.TYPE_UINT32, F.TYPE_FIXED64, F.TYPE_FIXED32)
    bits = 64 if t in (F.TYPE_UINT64, F.TYPE_FIXED64, F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64) else 32
    lo, hi = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return st.one_of(st.sampled_from([lo, hi, 0, 1, -1 if lo < 0 else 2, 7]), st.integers(lo, hi))


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


def mutate(message, data) -> None:
    """Overwrite one leaf of ``message``, drawn over its populated tree."""
    parent, field = data.draw(st.sampled_from(leaves(message)), label="field")
    if field.type == F.TYPE_MESSAGE:
        if field.is_repeated:  # drop the list, or add an empty element
            items = getattr(parent, field.name)
            if data.draw(st.booleans(), label="drop"):
                del items[:]
            else:
                items.add()
        else:
            getattr(parent, field.name).SetInParent()  # an empty sub-message
        return
    if field.is_repeated:
        items = getattr(parent, field.name)
        del items[:]
        value = data.draw(value_strategy(field, None), label=field.name)
        items.extend([value] * data.draw(st.sampled_from(REPEATS), label="repeats"))
        return
    setattr(parent, field.name, data.draw(value_strategy(field, getattr(parent, field.name)), label=field.name))


@pytest.fixture(scope="module")
def cluster(workdir):
    # A handshake to a refused address waits for its one retry up to the handshake timeout:
    # 0.5 s instead of the default's 2 s keeps about twenty such examples quick.
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="fz", daemon_args=("--handshake-timeout-s", "0.5")) as c:
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
        "Reads": ("engine", pb.ReadBatch(engine_id=engine_id, reads=[cluster.decode_clients[0].read_spec(
            "fz-s", cluster.prefill_id, "fz", request.local_block_ids, request.remote_block_ids, deadline_s=2)])),
        "Hold": ("prefill", pb.HoldRequest(engine_id=cluster.prefill_id, request_id="fz",
                                           block_ids=ids(request.remote_block_ids), lease_s=1)),
        "RenewLease": ("prefill", pb.RenewLeaseRequest(engine_id=cluster.prefill_id, request_ids=["fz"], lease_s=1)),
        "Release": ("prefill", pb.ReleaseRequest(engine_id=cluster.prefill_id, request_id="fz")),
        "MissedEvents": ("prefill", pb.MissedEventsRequest(engine_id=cluster.prefill_id, after_seq=0)),
        "GetEngineInfo": ("peer", pb.EngineInfoRequest(
            engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id="fz-reader",
            reader_tp_rank=0, reader_tp_size=1, reader_agent_metadata=reader.agent_metadata)),
        "GetIncarnation": ("peer", pb.IncarnationRequest(engine_id=cluster.prefill_id)),
        "RenewLeases": ("peer", pb.RenewLeaseRequest(engine_id=cluster.prefill_id, request_ids=["fz"], lease_s=1)),
    }


def call(stubs, service: str, method: str, message, metadata):
    stub = stubs[service]
    if method == "Reads":  # one batch; the first answer (completions or the end of the stream) is enough
        stream = stub.Reads(iter([message]), timeout=ANSWER_S, metadata=metadata)
        try:
            return next(stream, None)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not message.reads:
                return None  # nothing to answer: a stream may stay silent
            raise
        finally:
            stream.cancel()
    return getattr(stub, method)(message, timeout=ANSWER_S, metadata=metadata)


METHODS = ["Register", "Heartbeat", "Deregister", "Handshake", "Reads", "Hold",
           "RenewLease", "Release", "MissedEvents", "GetEngineInfo", "GetIncarnation", "RenewLeases"]


@pytest.mark.parametrize("method", METHODS)
def test_malformed_input_gets_a_precise_status_in_time(cluster, method):
    arenas: list = []
    channels = {"engine": grpc.insecure_channel(cluster.decode_daemons[0].engine_target),
                "prefill": grpc.insecure_channel(cluster.prefill_daemons[0].engine_target),
                "peer": peer_channel(cluster.prefill_daemons[0].peer_address)}
    stubs = {"engine": engine_grpc.EngineServiceStub(channels["engine"]),
             "prefill": engine_grpc.EngineServiceStub(channels["prefill"]), "peer": peer_grpc.PeerServiceStub(channels["peer"])}
    sessions = {"engine": cluster.decode_clients[0].session, "prefill": cluster.prefill_clients[0].session, "peer": ""}
    service, base = base_messages(cluster, arenas)[method]
    metadata = [("kvxferd-session", sessions[service])] if sessions[service] else []
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES_PER_RPC, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def one_case(data):
        seen["cases"] = seen.get("cases", 0) + 1
        message = type(base)()
        message.CopyFrom(base)
        for _ in range(data.draw(st.integers(1, 3), label="num_mutations")):
            mutate(message, data)
        try:
            reply = call(stubs, service, method, message, metadata)
            refused = [c.refused_code for c in reply.completions if c.refused_code] if method == "Reads" and reply else []
            if refused:  # a stream answers bad reads with refusals, each naming its status
                assert all(grpc.StatusCode.INTERNAL.value[0] != code != grpc.StatusCode.UNKNOWN.value[0]
                           for code in refused), reply
                seen["refused"] = seen.get("refused", 0) + 1
                return
            seen["OK"] = seen.get("OK", 0) + 1
        except grpc.RpcError as err:
            assert err.code() not in FORBIDDEN, f"{method}: {err.code().name}: {err.details()}\n{message}"
            seen[err.code().name] = seen.get(err.code().name, 0) + 1
            return
        if method == "Register":  # let the next example register again (and reach the deep checks)
            stubs["engine"].Deregister(pb.DeregisterRequest(engine_id=message.engine.engine_id), timeout=ANSWER_S,
                                       metadata=[("kvxferd-session", reply.session)])

    try:
        one_case()
        assert seen["cases"] >= EXAMPLES_PER_RPC, seen  # every example ran
        errors = sum(n for code, n in seen.items() if code not in ("OK", "cases"))
        assert errors >= EXAMPLES_PER_RPC // 4, seen  # mostly bad input
    finally:
        for channel in channels.values():
            channel.close()
        for arena in arenas:
            arena.close()
    cluster.decode_clients[0].stub.Heartbeat(pb.HeartbeatRequest(engine_id=cluster.decode_id), timeout=ANSWER_S)
    if method == "Reads":
        cluster.decode_clients[0].reconnect_reads()  # fuzzed streams replaced the engine's own
    cluster.prefill_clients[0].release("fz") if _held(cluster, "fz") else None
    read_still_works(cluster, f"after-{method}", seed=len(method))


def _held(cluster: DaemonCluster, request_id: str) -> bool:
    unknown = cluster.prefill_clients[0].renew([request_id], lease_s=1)
    return not unknown
