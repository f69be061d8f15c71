"""What a daemon tells its peers at handshake, and how a peer checks it.

Decoding is two-phase: first the envelope (protocol version, compatibility
hash), then the payload. A peer of another protocol version or serving a
different model is refused with an error naming the field, before anything
of the payload is trusted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvxferd.errors import InvalidArgumentError, KvxferError, LayoutMismatchError
from kvxferd.layout.specs import AttentionSpec
from kvxferd.plan.board import BoardInfo, check_num_buckets
from kvxferd.plan.capability import HOLD_KEY_BYTES
from kvxferd.plan.groups import EngineCache
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.messages import (engine_from_pb, engine_to_pb, host_share_from_handle, host_share_to_pb,
                                   peer_memory_from_pb)

# 2: readers introduce their TP size (required); 3: notices and acks are binary records;
# 4: hold boards replace acks (EngineInfo.hold_board required; notices from a second agent, unanswered)
# 5: notices say whether the reader needed the holder's progress (flag bit 1: a holder of v4 refuses it)
# 6: reads are sealed: EngineInfo.hold_key, capabilities in reads and notices (record version 2)
# 7: every peer call follows a Challenge the answering daemon passes (issue #53); same-host tokens bound to it
PROTOCOL_VERSION = 7


def model_facts(cache: EngineCache) -> str:
    """What both sides of a transfer must agree on, in words (layouts and TP may differ)."""
    parts = []
    for g, group in enumerate(cache.groups):
        spec = group.spec
        if isinstance(spec, AttentionSpec):
            facts = f"heads={spec.num_kv_heads},head_size={spec.head_size},dtype={spec.dtype}"
            if spec.strides is not None:  # one region holds every layer; what a (head, token) holds must match
                facts += f",layers={spec.num_layers},content={spec.strides.content}"
        else:
            facts = (f"heads={spec.num_heads},head_dim={spec.head_dim},groups={spec.num_groups},state={spec.state_size},"
                     f"window={spec.conv_window},dtypes={spec.conv_dtype}/{spec.ssm_dtype}")
            if spec.layer_stride is not None:  # one region holds every layer
                facts += f",layers={spec.num_layers}"
            if spec.conv_parts != "xBC":  # GDN's conv channels (Mamba2's facts stay what they were)
                facts += f",conv={spec.conv_parts}"
        parts.append(f"[{g}] {group.kind} x{group.num_regions}: {facts}")
    return "; ".join(parts)


def compatibility_hash(cache: EngineCache) -> str:
    return hashlib.sha256(model_facts(cache).encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class PeerInfo:
    """A remote rank as its daemon describes it."""

    incarnation: str
    agent_metadata: bytes
    cache: EngineCache
    board: BoardInfo
    same_host_proof: str = ""  # with shared-memory names: the holder's proof (kvxferd.wire.samehost)
    writer_agent_name: str = ""  # push (issue #57): whose notices say this rank's writes ended


def encode_info(incarnation: str, agent_metadata: bytes, cache: EngineCache, board: BoardInfo, *,
                same_host_proof: str = "", writer_agent_name: str = "", with_shares: bool = False
                ) -> pb.EngineInfoReply:
    """The holder's answer to ``GetEngineInfo``; ``same_host_proof``: the reader proved it shares this host
    (kvxferd.wire.samehost), and gets the names of the shared-memory objects to map itself, with the
    holder's own proof. ``with_shares``: those names without a proof (a reader naming its rank as a push
    target: the writer uses them only once the reader's token proved this host)."""
    same_host = bool(same_host_proof) or with_shares
    info = pb.EngineInfo(incarnation=incarnation, agent_metadata=agent_metadata,
                         engine=engine_to_pb(cache, with_addresses=True, with_shares=same_host),
                         hold_board=pb.HoldBoard(address=board.address, num_buckets=board.num_buckets),
                         hold_key=board.hold_key, same_host_proof=same_host_proof,
                         writer_agent_name=writer_agent_name)
    if same_host and board.share is not None:  # the board's memfd, mapped by the reader to check holds
        host_share_to_pb(board.share, info.hold_board.share)
    return pb.EngineInfoReply(protocol_version=PROTOCOL_VERSION, compatibility_hash=compatibility_hash(cache),
                              payload=info.SerializeToString())


def decode_info(reply: pb.EngineInfoReply, local: EngineCache) -> PeerInfo:
    """Check the envelope against ``local`` (protocol version, then compatibility hash: FAILED_PRECONDITION,
    whatever the payload holds), then decode the payload and check it says what the envelope says."""
    if reply.protocol_version != PROTOCOL_VERSION:
        raise LayoutMismatchError("protocol_version", f"peer speaks v{reply.protocol_version}, this daemon v{PROTOCOL_VERSION}")
    if reply.compatibility_hash != compatibility_hash(local):
        raise LayoutMismatchError("compatibility_hash", f"peer model [{_facts_of(reply)}] vs local "
                                                        f"[{model_facts(local)}]")
    info = pb.EngineInfo()
    try:
        info.ParseFromString(reply.payload)
    except DecodeError as err:
        raise InvalidArgumentError("payload", f"undecodable engine info: {err}") from None
    remote = engine_from_pb(info.engine, peer_memory_from_pb(info.engine))
    if compatibility_hash(remote) != reply.compatibility_hash:  # an envelope that does not match its payload
        raise LayoutMismatchError("compatibility_hash", f"peer model [{model_facts(remote)}] vs local [{model_facts(local)}]")
    return PeerInfo(info.incarnation, info.agent_metadata, remote, decode_board(info), info.same_host_proof,
                    info.writer_agent_name)


def _facts_of(reply: pb.EngineInfoReply) -> str:
    """The peer's model in words for a refusal, where its payload says (else its hash only)."""
    try:
        info = pb.EngineInfo()
        info.ParseFromString(reply.payload)
        return model_facts(engine_from_pb(info.engine, peer_memory_from_pb(info.engine)))
    except (DecodeError, KvxferError):
        return f"hash {reply.compatibility_hash[:32]!r}"


def decode_board(info: pb.EngineInfo) -> BoardInfo:
    """The holder's board: required, a power of two of buckets at a nonzero, 8-byte aligned address."""
    if not info.HasField("hold_board"):
        raise InvalidArgumentError("hold_board", "the peer announced no hold board")
    board = info.hold_board
    if not board.address or board.address % 8:
        raise InvalidArgumentError("hold_board.address", f"{board.address:#x} is not a u64-aligned address")
    if len(info.hold_key) != HOLD_KEY_BYTES:
        raise InvalidArgumentError("hold_key", f"{len(info.hold_key)} bytes, a hold key is {HOLD_KEY_BYTES}")
    share = host_share_from_handle(board.share, "hold_board.share") if board.HasField("share") else None
    return BoardInfo(board.address, check_num_buckets(board.num_buckets, "hold_board.num_buckets"), info.hold_key,
                     share)
