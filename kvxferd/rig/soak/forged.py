"""Forged read notices: a rogue NIXL agent tells a holder that readers are done with a hold.

Without TLS anyone on the peer port can be introduced as *a* reader and so
learn a holder's agent metadata; with it the rogue can send the holder NIXL
notifications. What it must never achieve: a notice naming a real reader
counts only from the agent that reader introduced (else it is dropped as
``foreign``), and bytes that are not a notice are dropped as ``malformed``.
Either way the hold lives on until its real readers report::

    rogue ── GetEngineInfo (introduced as reader "soak-forger") ──► holder's agent metadata
          ── notices naming the real decode ranks, ok ────────────► dropped (foreign)
          ── junk and a truncated notice ─────────────────────────► dropped (malformed)
"""

from __future__ import annotations

import time

import numpy as np

from kvxferd.plan.notifications import ReadNotice
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.peerauth import peer_channel
from kvxferd.wire.peerinfo import PROTOCOL_VERSION
from kvxferd.xfer.nixl.agent import NixlAgent

FORGER_ENGINE_ID = "soak-forger"
SEND_S = 0.05  # the rogue polls its agent this long after sending: no progress thread drives the send


def holder_info(peer_address: str, engine_id: str, tp_rank: int, agent: NixlAgent, reader_engine_id: str,
                reader_tp_size: int = 1, timeout_s: float = 10.0) -> pb.EngineInfo:
    """Introduce ``agent`` as a reader (a same-host daemon's user can, with the host's peer secret) and get the
    holder rank's engine info."""
    with peer_channel(peer_address) as channel:
        reply = peer_grpc.PeerServiceStub(channel).GetEngineInfo(pb.EngineInfoRequest(
            engine_id=engine_id, protocol_version=PROTOCOL_VERSION, tp_rank=tp_rank, reader_engine_id=reader_engine_id,
            reader_tp_rank=0, reader_tp_size=reader_tp_size, reader_agent_metadata=agent.metadata()), timeout=timeout_s)
    info = pb.EngineInfo()
    info.ParseFromString(reply.payload)
    return info


def send(agent: NixlAgent, holder_metadata: bytes, messages: list[bytes], send_s: float = SEND_S) -> str:
    """Send ``messages`` from ``agent`` to the holder (loaded once per metadata); its agent name."""
    holder = agent.add_remote(holder_metadata)
    for message in messages:
        agent.notify(holder, message)
    deadline = time.monotonic() + send_s
    while time.monotonic() < deadline:
        agent.poll_notifications()
        time.sleep(0.005)
    return holder


class NoticeForger:
    """One rogue agent for a whole soak; :meth:`forge` against any prefill rank's daemon life."""

    def __init__(self) -> None:
        self.agent = NixlAgent("soak-forger")

    def forge(self, peer_address: str, engine_id: str, tp_rank: int, request_id: str, decode_engine_id: str,
              decode_tp: int, rng: np.random.Generator) -> tuple[int, int]:
        """Forged notices for ``request_id`` to one holder rank: ``(foreign, malformed)`` sent."""
        info = holder_info(peer_address, engine_id, tp_rank, self.agent, FORGER_ENGINE_ID)
        foreign = [ReadNotice(request_id, decode_engine_id, r, int(rng.integers(1, 4)), True).encode()
                   for r in range(decode_tp)]
        good = foreign[0]
        malformed = [rng.bytes(int(rng.integers(1, 64))), good[:-1], b"KA" + good[2:]]
        send(self.agent, info.agent_metadata, foreign + malformed)
        return len(foreign), len(malformed)

    def close(self) -> None:
        self.agent.close()
