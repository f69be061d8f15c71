"""Bursts of bad input on every listener of one daemon, between valid requests.

Engine gRPC (no session, unknown ids, damaged fields), peer gRPC (unknown
engines, wrong protocol versions, junk agent names), and raw bytes on the
engine socket, the reads socket, the peer port, the notify bus and the metrics port. Each
must be refused (any status but UNKNOWN, INTERNAL, or no answer in time)
and leave the daemon serving; the soak's crash check and the next valid
request prove the second part.
"""

from __future__ import annotations

import socket
import urllib.parse

import grpc
import numpy as np

from kvxferd.client import DaemonProcess
from kvxferd.proto.v1 import engine_service_pb2_grpc as engine_grpc
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.frames import reads_socket_path
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION

ANSWER_S = 3.0
BROKEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


def _junk_text(rng: np.random.Generator) -> str:
    return str(rng.choice(["", "\0", "x" * 300, "ghost", "../..", "é" * 40, "a\0b"]))


def _ids(rng: np.random.Generator) -> list[pb.BlockIds]:
    return [pb.BlockIds(ids=[int(i) for i in rng.integers(-2**31, 2**31 - 1, int(rng.integers(0, 6)))])]


def _engine_calls(stub, rng: np.random.Generator, engine_id: str):
    """Calls an engine service must refuse: unknown or foreign engines, damaged fields, no session."""
    junk = _junk_text(rng)
    return [
        lambda: stub.Hold(pb.HoldRequest(engine_id=engine_id, request_id=junk, block_ids=_ids(rng),
                                         lease_s=float(rng.choice([-1.0, 1e300, float("nan")]))), timeout=ANSWER_S),
        lambda: stub.Handshake(pb.HandshakeRequest(engine_id=junk, remote_engine_id=junk,
                                                   peer_addresses=[junk] * int(rng.integers(0, 3))), timeout=ANSWER_S),
        lambda: stub.Register(pb.RegisterRequest(engine=pb.EngineRank(engine_id=junk, tp_size=-1)), timeout=ANSWER_S),
        lambda: stub.Release(pb.ReleaseRequest(engine_id=engine_id, request_id=junk), timeout=ANSWER_S),
        lambda: stub.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id), timeout=ANSWER_S),
        lambda: stub.MissedEvents(pb.MissedEventsRequest(engine_id=engine_id, after_seq=2**63), timeout=ANSWER_S),
        lambda: stub.Handshake(pb.HandshakeRequest(engine_id=engine_id, remote_engine_id=junk,
                                                   peer_addresses=["127.0.0.1:1"]), timeout=ANSWER_S),
    ]


def _peer_calls(stub, rng: np.random.Generator, engine_id: str):
    return [
        lambda: stub.GetEngineInfo(pb.EngineInfoRequest(engine_id=engine_id, protocol_version=PROTOCOL_VERSION + 7),
                                   timeout=ANSWER_S),
        lambda: stub.GetEngineInfo(pb.EngineInfoRequest(engine_id=_junk_text(rng), protocol_version=PROTOCOL_VERSION),
                                   timeout=ANSWER_S),
        lambda: stub.RenewLeases(pb.RenewLeaseRequest(engine_id=engine_id, request_ids=["x"] * 3, lease_s=-5),
                                 timeout=ANSWER_S),
    ]


def _raw(family, address, payload: bytes) -> None:
    """Connect, send junk, close; whatever the listener answers is ignored."""
    with socket.socket(family, socket.SOCK_STREAM) as raw:
        raw.settimeout(1.0)
        try:
            raw.connect(address)
            raw.sendall(payload)
            raw.recv(64)
        except OSError:
            pass


def _host_port(address: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(address if "://" in address else f"tcp://{address}")
    return parsed.hostname, parsed.port


def burst(daemon: DaemonProcess, engine_id: str, rng: np.random.Generator) -> tuple[int, list[str]]:
    """Bad input on every listener of ``daemon``; ``(messages sent, wrong answers)``."""
    wrong, sent = [], 0
    with grpc.insecure_channel(daemon.engine_target) as engine, peer_channel(daemon.peer_address) as peer:
        calls = _engine_calls(engine_grpc.EngineServiceStub(engine), rng, engine_id)
        calls += _peer_calls(peer_grpc.PeerServiceStub(peer), rng, engine_id)
        for call in calls:
            sent += 1
            try:
                call()
                wrong.append(f"{daemon.daemon_id}: a bad call was accepted")
            except grpc.RpcError as err:
                if err.code() in BROKEN:
                    wrong.append(f"{daemon.daemon_id}: bad input answered {err.code().name}: {err.details()}")
    junk = rng.bytes(int(rng.integers(1, 4096)))
    _raw(socket.AF_UNIX, daemon.socket, junk)
    _raw(socket.AF_UNIX, reads_socket_path(daemon.socket), junk)  # read as frames: ended with a status
    for name in ("peer", "notify", "metrics"):
        payload = b"GET /\xff\x00 HTTP/9\r\n\r\n" if name == "metrics" else junk
        _raw(socket.AF_INET, _host_port(daemon.addresses[name]), payload)
    return sent + 5, wrong
