"""Helpers shared by the tests that drive real daemons."""

from __future__ import annotations

import queue
import socket
import time

import grpc
import numpy as np
import pytest

from kvxferd.client import SharedArena, engine_rank_pb
from kvxferd.plan.engine import ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.challenge import ChallengeBook, secret_proof
from kvxferd.wire.frames import FrameReader, encode_frame
from kvxferd.wire.peerauth import default_peer_secret_file, peer_channel, read_peer_secret
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.rig.verify.models import ModelShape, model_groups

GQA_GROUPS = model_groups("gqa", ModelShape())  # (prefill, decode) groups of the Reads tests' clusters


class ProxyPeer(peer_grpc.PeerServiceServicer):
    """A test's stand-in for a holder's peer port that forwards to the real one (set ``address`` to where it
    listens). It holds the host's peer secret, as a daemon of this user does, so it passes the challenges
    of the daemons that dial it (for its own address); it does not check their tokens."""

    def __init__(self, target: str) -> None:
        self.stub = peer_grpc.PeerServiceStub(peer_channel(target))
        self.secret = read_peer_secret(default_peer_secret_file())
        self.challenges = ChallengeBook()
        self.address = ""

    def Challenge(self, request, context):  # noqa: N802 - gRPC's name
        nonces = self.challenges.issue(request.client_nonce)
        return pb.ChallengeReply(protocol_version=request.protocol_version, server_nonce=nonces.server,
                                 proof=secret_proof(self.secret, self.address, nonces))


def two_block_request(name: str, k: int) -> ReadRequest:
    """Request ``k`` (< 32) of a :data:`GQA_GROUPS` cluster reads two blocks of its own on the decode side:
    concurrent reads never overlap."""
    ids = np.arange(2 * k, 2 * k + 2) % 64
    return ReadRequest(name, f"{name}@p", tuple(ids for _ in GQA_GROUPS[1]), tuple(ids for _ in GQA_GROUPS[0]), 32)


def engine_pb(groups, engine_id: str = "other", arenas: list | None = None, tagged: bool = False) -> pb.EngineRank:
    """A Register message for a one-rank engine whose cache lies in a new shared arena (appended to ``arenas``);
    ``tagged``: its blocks hold the oracle's tagged bytes (a prefill's)."""
    holder: list[SharedArena] = []

    def allocate(num_bytes):
        holder.append(SharedArena(num_bytes))
        return holder[-1].array

    engine = allocate_engine(engine_id, groups, 1, 0, tagged=tagged, allocate=allocate)
    if arenas is not None:
        arenas.extend(holder)
    return engine_rank_pb(engine.cache, holder[0])


def second_completion_stream(target: str, engine_id: str, groups, arenas: list, answer_s: float = 5.0):
    """Register ``engine_id`` on the daemon at ``target`` and open its gRPC ``Reads`` stream twice: the first
    stream's ending ``(code, details)``; then Deregister, which must end the second at once, FAILED_PRECONDITION
    (asserted)."""
    from kvxferd.client import EngineClient

    client = EngineClient(target)
    outboxes: list[queue.SimpleQueue] = []

    def reads_stream():
        outbox = queue.SimpleQueue()
        outboxes.append(outbox)
        outbox.put(pb.ReadBatch(engine_id=engine_id))
        return client.stub.Reads(iter(outbox.get, None), timeout=answer_s * 2)
    try:
        client.session = client.stub.Register(pb.RegisterRequest(engine=engine_pb(groups, engine_id, arenas)),
                                              timeout=30).session
        first = reads_stream()
        time.sleep(1.0)  # the first stream is current
        second = reads_stream()  # kept: a dropped call is cancelled
        ended = status(lambda: list(first))
        client.stub.Deregister(pb.DeregisterRequest(engine_id=engine_id), timeout=answer_s)
        # ended, well before its deadline: the registration's end, not OK (issue 61)
        assert status(lambda: list(second))[0] == grpc.StatusCode.FAILED_PRECONDITION
        return ended
    finally:
        for outbox in outboxes:
            outbox.put(None)
        client.close()


CODES = {code.value[0]: code for code in grpc.StatusCode}


def oversized_batch(target: str, groups, arenas: list, engine_id: str = "oversized") -> tuple[grpc.StatusCode, str]:
    """How a session ends that sends a ``Reads`` batch over the daemon's ``--max-message-bytes`` (100,000
    block ids), from an engine of its own: the client would send that batch again on every new session."""
    from kvxferd.client import EngineClient

    client = EngineClient(target)
    try:
        client.register(engine_pb(groups, engine_id, arenas))
        huge = [np.arange(100_000, dtype=np.int64)]
        client.submit_read("huge", "nobody", "x", huge, huge)
        deadline = time.monotonic() + 10
        while client.reads.stream_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        error = client.reads.stream_error
        assert error is not None, "the session outlived an oversized batch"
        return error.code(), error.details()
    finally:
        client.deregister()
        client.close()


def refusal(client, request_id: str, *args, timeout_s: float = 10.0, **kwargs) -> tuple[grpc.StatusCode | None, str]:
    """Submit one read (:meth:`EngineClient.submit_read`'s arguments) and wait for its completion: the status
    code it was refused with and its error, or ``(None, error)`` when it was not refused (it ran)."""
    client.submit_read(request_id, *args, **kwargs)
    completion = client.reads.wait_completion(request_id, timeout_s)
    return (CODES[completion.refused_code] if completion.refused_code else None), completion.error


def status(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call that must fail."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def frame(message) -> bytes:
    """One reads-socket frame of ``message``."""
    return encode_frame(message.SerializeToString())


def raw_session(path: str, raw_frames: list[bytes], timeout_s: float = 10.0,
                num_batches: int | None = None) -> tuple[list[pb.CompletionBatch], int, str]:
    """Send raw frames on a new reads-socket connection, then read until the daemon closes it, ``num_batches``
    batches came, or ``timeout_s`` passes without a frame: every batch before the end frame, and the end
    frame's code and message (0 and "" if there was none)."""
    batches, frames = [], FrameReader(1 << 24)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        for raw in raw_frames:
            conn.sendall(raw)
        try:
            while data := conn.recv(1 << 16):
                for payload in frames.feed(data):
                    batch = pb.CompletionBatch.FromString(payload)
                    if batch.end_code:
                        return batches, batch.end_code, batch.end_message
                    batches.append(batch)
                    if num_batches is not None and len(batches) >= num_batches:
                        return batches, 0, ""
        except TimeoutError:
            pass  # still open: what came so far
    return batches, 0, ""
