"""A handshake proves the data plane before it answers: each holder's board is read once over NIXL.

UCX sets a connection up on its first transfer (10-35 ms here), so the
handshake pays for it and the first request does not (measured in
docs/benchmarks.md, "The first read after a handshake"). A holder whose
gRPC answers but whose memory does not fails the handshake, naming its
address, instead of failing the reads after it.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from tests.service.helpers import ProxyPeer

GROUPS = model_groups("gqa", ModelShape())
HANDSHAKE_TIMEOUT_S = 2.0


class FreezingPeer(ProxyPeer):
    """Answers GetEngineInfo with the real holder's answer, freezing the holder (SIGSTOP) just before:
    its gRPC has answered, its NIXL agent will not."""

    def __init__(self, address: str, pid: int) -> None:
        super().__init__(address)
        self.pid = pid

    def GetEngineInfo(self, request, context):
        reply = self.stub.GetEngineInfo(request, timeout=10)
        os.kill(self.pid, signal.SIGSTOP)
        return reply


def test_a_handshake_fails_when_the_holders_data_plane_does_not_answer(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="probe",
                       daemon_args=("--handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S))) as cluster:
        holder = cluster.prefill_daemons[0]
        server = grpc.server(futures.ThreadPoolExecutor(2))
        freezing = FreezingPeer(holder.peer_address, holder.process.pid)
        peer_grpc.add_PeerServiceServicer_to_server(freezing, server)
        proxy = freezing.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        try:
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as failed:
                cluster.decode_clients[0].handshake(cluster.prefill_id, [proxy])
            took_s = time.perf_counter() - start
        finally:
            os.kill(holder.process.pid, signal.SIGCONT)
            server.stop(0)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "peer_addresses[0]" in failed.value.details() and proxy in failed.value.details()
        assert "data plane did not answer" in failed.value.details()
        assert HANDSHAKE_TIMEOUT_S <= took_s < HANDSHAKE_TIMEOUT_S + 5
        # The holder thawed: a handshake with its own address connects again and reads are byte-exact.
        cluster.handshake()
        request = random_request("after-probe", *GROUPS, 48, np.random.default_rng(0))
        completions = cluster.read(request)
        assert all(c.ok for c in completions), [c.error for c in completions]
        assert cluster.verify(request) == ([], 0)
