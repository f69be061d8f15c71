"""Bad input on every RPC gets a precise status, and the daemon keeps serving others."""

import os

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvxferd.client import EngineClient
from kvxferd.wire.peerauth import peer_channel
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.peerinfo import PROTOCOL_VERSION

from tests.service.helpers import engine_pb, oversized_batch, refusal, status

C = grpc.StatusCode
GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="bad", daemon_args=("--max-message-bytes", "65536")) as c:
        yield c


def test_register(cluster):
    stub = cluster.decode_clients[0].stub
    arenas = []
    good = engine_pb(GROUPS[1], arenas=arenas)
    cases = []
    no_handle = pb.EngineRank(); no_handle.CopyFrom(good); no_handle.groups[0].regions[0].ClearField("handle")
    cases.append((no_handle, C.INVALID_ARGUMENT, "engine.groups[0].regions[0].handle"))
    missing = pb.EngineRank(); missing.CopyFrom(good); missing.groups[0].regions[1].handle.shm_name = "kvx-missing"
    cases.append((missing, C.NOT_FOUND, "engine.groups[0].regions[1].shm_name"))
    too_far = pb.EngineRank(); too_far.CopyFrom(good); too_far.groups[0].regions[0].handle.offset = 1 << 40
    cases.append((too_far, C.INVALID_ARGUMENT, "exceeds"))
    bad_dtype = pb.EngineRank(); bad_dtype.CopyFrom(good); bad_dtype.groups[0].attention.dtype = "float7"
    cases.append((bad_dtype, C.INVALID_ARGUMENT, "engine.groups[0].attention.dtype"))
    bad_tp = pb.EngineRank(); bad_tp.CopyFrom(good); bad_tp.tp_rank = 3
    cases.append((bad_tp, C.INVALID_ARGUMENT, "tp"))
    gpu_as_host = pb.EngineRank(); gpu_as_host.CopyFrom(good)
    gpu_as_host.groups[0].regions[0].handle.cuda_ipc_handle = b"\0" * 64
    cases.append((gpu_as_host, C.INVALID_ARGUMENT, "VRAM"))
    bad_ipc = pb.EngineRank(); bad_ipc.CopyFrom(gpu_as_host); bad_ipc.mem_type = "VRAM"
    for group in bad_ipc.groups:
        for region in group.regions:
            region.handle.cuda_ipc_handle = b"\0" * 64
    no_gpu = not os.path.exists("/dev/nvidia0")  # no GPU: refused as unavailable here, not as a bad handle
    cases.append((bad_ipc, C.FAILED_PRECONDITION if no_gpu else C.INVALID_ARGUMENT, "regions[0]"))
    for message, code, text in cases:
        got, details = status(lambda: stub.Register(pb.RegisterRequest(engine=message)))
        assert (got, text in details) == (code, True), details
    assert status(lambda: stub.Register(pb.RegisterRequest(engine=good, lease_s=-1)))[0] == C.INVALID_ARGUMENT
    for arena in arenas:
        arena.close()


def test_unknown_engine_everywhere(cluster):
    stub = cluster.decode_clients[0].stub
    calls = [
        lambda: stub.Heartbeat(pb.HeartbeatRequest(engine_id="ghost")),
        lambda: stub.Deregister(pb.DeregisterRequest(engine_id="ghost")),
        lambda: stub.Handshake(pb.HandshakeRequest(engine_id="ghost", remote_engine_id="x", peer_addresses=["a:1"])),
        lambda: stub.Hold(pb.HoldRequest(engine_id="ghost", request_id="r")),
        lambda: stub.RenewLease(pb.RenewLeaseRequest(engine_id="ghost", request_ids=["r"])),
        lambda: stub.Release(pb.ReleaseRequest(engine_id="ghost", request_id="r")),
        lambda: list(stub.Reads(iter([pb.ReadBatch(engine_id="ghost")]))),
    ]
    for call in calls:
        code, details = status(call)
        assert code == C.NOT_FOUND and details.startswith("engine_id"), details


def test_handshake(cluster):
    decode = cluster.decode_clients[0]
    prefill_address = cluster.prefill_daemons[0].peer_address
    assert status(lambda: decode.handshake(cluster.prefill_id, []))[0] == C.INVALID_ARGUMENT
    code, details = status(lambda: decode.handshake("nobody", [prefill_address]))
    assert code == C.NOT_FOUND and details.startswith("peer_addresses[0]")
    code, details = status(lambda: decode.handshake(cluster.prefill_id, [prefill_address, prefill_address]))
    assert code == C.INVALID_ARGUMENT and details.startswith("peer_addresses[1]") and "listed already" in details
    assert status(lambda: decode.handshake(cluster.prefill_id, ["127.0.0.1:1"]))[0] == C.UNAVAILABLE
    for address in ("127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:", ":1", "ghost", "unix:/tmp/x", "[]:1"):
        code, details = status(lambda: decode.handshake(cluster.prefill_id, [address]))  # refused before dialling
        assert code == C.INVALID_ARGUMENT and "host:port" in details, (address, details)
    # None of these broke the working link: a read still goes to the right addresses.
    request = random_request("kept", *GROUPS, 32, np.random.default_rng(1))
    assert all(c.ok for c in cluster.read(request))
    # A model that does not match (other head size) is refused, naming the hash.
    arenas = []
    other_groups = model_groups("gqa", ModelShape(head_size=32))[0]
    other = EngineClient(cluster.prefill_daemons[0].engine_target)
    other.register(engine_pb(other_groups, "mismatched", arenas))
    code, details = status(lambda: decode.handshake("mismatched", [prefill_address]))
    assert code == C.FAILED_PRECONDITION and "compatibility_hash" in details
    other.deregister()
    other.close()
    for arena in arenas:
        arena.close()
    decode.handshake(cluster.prefill_id, [prefill_address])  # the good one still works (idempotent)


def test_submit_read(cluster):
    """Each bad read of a batch is refused as its completion (``refused_code``), naming the field."""
    decode = cluster.decode_clients[0]
    request = random_request("r", *GROUPS, 48, np.random.default_rng(0))
    ids = dict(local_block_ids=request.local_block_ids, remote_block_ids=request.remote_block_ids)

    def submit(request_id="r", remote=cluster.prefill_id, **changes):
        args = {**ids, **changes}
        deadline = args.pop("deadline_s", 0.0)
        return refusal(decode, request_id, remote, "p", args["local_block_ids"], args["remote_block_ids"],
                       deadline_s=deadline)

    assert submit(remote="nobody")[0] == C.NOT_FOUND
    code, details = submit(request_id="r1", remote_block_ids=[[10_000]])
    assert code == C.INVALID_ARGUMENT and details.startswith("groups[0]"), details
    code, details = submit(request_id="r2", local_block_ids=[[0], [1]])
    assert code == C.INVALID_ARGUMENT and details.startswith("local_block_ids"), details
    assert submit(request_id="")[0] == C.INVALID_ARGUMENT
    assert submit(request_id="r3", deadline_s=-1)[0] == C.INVALID_ARGUMENT

def test_a_batch_over_the_message_limit_ends_its_session(cluster, arenas):
    """Over --max-message-bytes (64 KiB here) a batch is not a read to refuse but a session to end."""
    code, details = oversized_batch(cluster.decode_daemons[0].engine_target, GROUPS[1], arenas)
    assert code == C.RESOURCE_EXHAUSTED, details


def test_holds_and_events(cluster):
    prefill = cluster.prefill_clients[0]
    code, details = status(lambda: prefill.hold("h", [[1_000_000]]))
    assert code == C.INVALID_ARGUMENT and details.startswith("block_ids[0]")
    assert status(lambda: prefill.hold("h", [[1], [2]]))[0] == C.INVALID_ARGUMENT
    prefill.hold("h", [[1, 2]])
    code, details = status(lambda: prefill.hold("h", [[1, 2]]))
    assert code == C.INVALID_ARGUMENT and "already held" in details
    prefill.release("h")
    assert status(lambda: prefill.release("h"))[0] == C.NOT_FOUND
    assert status(lambda: prefill.missed_events(10**6))[0] == C.INVALID_ARGUMENT


def test_peer_service(cluster):
    peer = peer_grpc.PeerServiceStub(peer_channel(cluster.prefill_daemons[0].peer_address))
    ask = pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=99)
    code, details = status(lambda: peer.GetEngineInfo(ask))
    assert code == C.FAILED_PRECONDITION and details.startswith("protocol_version")
    ask = pb.EngineInfoRequest(engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=1)
    assert status(lambda: peer.GetEngineInfo(ask))[0] == C.INVALID_ARGUMENT
    assert status(lambda: peer.GetIncarnation(pb.IncarnationRequest(engine_id="ghost")))[0] == C.NOT_FOUND
    reply = peer.GetIncarnation(pb.IncarnationRequest(engine_id=cluster.prefill_id))
    assert reply.incarnation == cluster.prefill_clients[0].incarnation


def test_health_and_reflection(cluster):
    channel = grpc.insecure_channel(cluster.prefill_daemons[0].peer_address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvxfer.v1.PeerService", "kvxfer.v1.EngineService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in reply.list_services_response.service}
    assert {"kvxfer.v1.EngineService", "kvxfer.v1.PeerService", "grpc.health.v1.Health"} <= names
    # A client such as grpcurl can describe each service: its file and the messages it imports.
    for service in ("kvxfer.v1.EngineService", "kvxfer.v1.PeerService"):
        ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
        (reply,) = reflection.ServerReflectionInfo(iter([ask]))
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in reply.file_descriptor_response.file_descriptor_proto]
        assert service.split(".")[-1] in {s.name for f in files for s in f.service}, reply


def test_still_serving_after_all_that(cluster):
    request = random_request("after", *GROUPS, 64, np.random.default_rng(5))
    cluster.reset_decode()
    assert all(c.ok for c in cluster.read(request))
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]
