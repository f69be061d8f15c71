"""Messages in and out: round trips, field-named errors, the status mapping."""

import grpc
import pytest

from kvxferd.errors import BlockIdError, InvalidArgumentError, LayoutMismatchError, NotFoundError, TransferError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base.status import status_code
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups
from kvxferd.wire.messages import (engine_from_pb, engine_to_pb, peer_memory_from_pb, read_request_from_spec,
                                   read_spec_to_pb)
from kvxferd.plan.board import BoardInfo
from kvxferd.wire.peerinfo import PROTOCOL_VERSION, compatibility_hash, decode_info, encode_info

BOARD = BoardInfo(0x7F00_0000_1000, 1024, bytes(range(32)))


@pytest.mark.parametrize("model", MODELS)
def test_engine_round_trip_through_peer_info(model):
    prefill_groups, decode_groups = model_groups(model, ModelShape(decode_block_size=32, kernel_block_size=8))
    prefill = allocate_engine("p", prefill_groups, 2, 1, tagged=False).cache
    decode = allocate_engine("d", decode_groups, 1, 0, tagged=False).cache
    peer = decode_info(encode_info("inc-1", b"meta", prefill, BOARD), decode)
    assert peer.incarnation == "inc-1" and peer.agent_metadata == b"meta" and peer.board == BOARD
    assert peer.cache.groups == prefill.groups and peer.cache.memory == prefill.memory
    assert (peer.cache.tp_rank, peer.cache.tp_size, peer.cache.engine_id) == (1, 2, "p")


def test_gdn_state_pages_round_trip_and_do_not_pair_with_mamba2_pages():
    from kvxferd.layout.specs import MambaSpec
    from kvxferd.plan.groups import CacheGroup

    def engine(conv_parts):
        spec = MambaSpec(num_blocks=4, num_heads=8, head_dim=4, num_groups=2, state_size=8, conv_window=3,
                         conv_order="DW", conv_parts=conv_parts)
        return allocate_engine("g", (CacheGroup("linear", spec, 2),), 1, 0, tagged=False).cache

    gdn = engine("BCx")
    assert decode_info(encode_info("i", b"", gdn, BOARD), gdn).cache.groups == gdn.groups
    with pytest.raises(LayoutMismatchError) as err:
        decode_info(encode_info("i", b"", gdn, BOARD), engine("xBC"))
    assert "conv=BCx" in err.value.message


def test_peer_of_another_model_or_version_is_refused():
    prefill_groups, _ = model_groups("gqa", ModelShape())
    other_groups, _ = model_groups("gqa", ModelShape(num_kv_heads=4))
    prefill = allocate_engine("p", prefill_groups, 1, 0, tagged=False).cache
    other = allocate_engine("d", other_groups, 1, 0, tagged=False).cache
    with pytest.raises(LayoutMismatchError) as err:
        decode_info(encode_info("i", b"", prefill, BOARD), other)
    assert err.value.field == "compatibility_hash" and "heads=8" in err.value.message
    reply = encode_info("i", b"", prefill, BOARD)
    reply.protocol_version = PROTOCOL_VERSION + 1
    with pytest.raises(LayoutMismatchError) as err:
        decode_info(reply, prefill)
    assert err.value.field == "protocol_version"
    reply = encode_info("i", b"", prefill, BOARD)
    reply.payload = b"\xff\xff garbage"
    with pytest.raises(InvalidArgumentError) as err:
        decode_info(reply, prefill)
    assert err.value.field == "payload"
    assert compatibility_hash(prefill) != compatibility_hash(other)
    # Issue 61: the envelope first. Another model's hash with an empty or garbled payload is the model's
    # refusal (FAILED_PRECONDITION), not the payload's.
    for payload in (b"", b"\xff\xff garbage"):
        reply = encode_info("i", b"", prefill, BOARD)
        reply.payload = payload
        with pytest.raises(LayoutMismatchError) as err:
            decode_info(reply, other)
        assert err.value.field == "compatibility_hash" and compatibility_hash(prefill)[:8] in err.value.message


@pytest.mark.parametrize("board, field", [(None, "hold_board"), (pb.HoldBoard(address=0, num_buckets=8), "hold_board.address"),
                                          (pb.HoldBoard(address=12, num_buckets=8), "hold_board.address"),
                                          (pb.HoldBoard(address=4096, num_buckets=6), "hold_board.num_buckets"),
                                          (pb.HoldBoard(address=4096, num_buckets=0), "hold_board.num_buckets"),
                                          ("short key", "hold_key")])
def test_a_peer_without_a_good_hold_board_is_refused(board, field):
    """Every read is checked against the holder's board and its hold key: a peer must announce a board that
    could exist, and a whole key."""
    prefill_groups, _ = model_groups("gqa", ModelShape())
    prefill = allocate_engine("p", prefill_groups, 1, 0, tagged=False).cache
    reply = encode_info("i", b"", prefill, BOARD)
    info = pb.EngineInfo.FromString(reply.payload)
    if board == "short key":
        info.hold_key = info.hold_key[:16]
    else:
        info.ClearField("hold_board")
    if board is not None and board != "short key":
        info.hold_board.CopyFrom(board)
    reply.payload = info.SerializeToString()
    with pytest.raises(InvalidArgumentError) as err:
        decode_info(reply, prefill)
    assert err.value.field == field


def engine_message(**attention):
    spec = dict(layout="packed_HND", num_blocks=8, num_kv_heads=4, head_size=16, block_size=16, dtype="bfloat16")
    spec.update(attention)
    group = pb.CacheGroup(kind="full", attention=pb.AttentionCache(**spec))
    group.regions.add(num_bytes=1 << 20)
    return pb.EngineRank(engine_id="e", tp_rank=0, tp_size=2, groups=[group])


@pytest.mark.parametrize("message, field", [
    (engine_message(layout="weird"), "engine.groups[0].attention.layout"),
    (engine_message(dtype="float7"), "engine.groups[0].attention.dtype"),
    (engine_message(head_size=0), "engine.groups[0].head_size"),
    (engine_message(kernel_block_size=5), "engine.groups[0].kernel_block_size"),
    (pb.EngineRank(engine_id="e", tp_size=1, groups=[pb.CacheGroup(kind="full")]), "engine.groups[0].spec"),
    (pb.EngineRank(engine_id="", tp_size=1), "engine.engine_id"),
    (pb.EngineRank(engine_id="e", tp_size=1), "engine.groups"),
    (pb.EngineRank(engine_id="e", tp_rank=3, tp_size=2, groups=engine_message().groups), "engine.groups[0].tp_rank"),
])
def test_bad_engine_messages_name_the_field(message, field):
    with pytest.raises(InvalidArgumentError) as err:
        engine_from_pb(message, peer_memory_from_pb(message))
    assert err.value.field == field


def test_read_requests_and_status_codes():
    request = read_request_from_spec(read_spec_to_pb("r", "e", "p", [[1, 2]], [[3, 4]]))
    assert [ids.tolist() for ids in request.local_block_ids] == [[1, 2]] and request.num_tokens is None
    with pytest.raises(InvalidArgumentError) as err:
        read_request_from_spec(read_spec_to_pb("", "e", "p", [[1, 2]], [[3, 4]]))
    assert err.value.field == "request_id"
    assert status_code(BlockIdError("f", "m")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(LayoutMismatchError("f", "m")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_code(NotFoundError("f", "m")) == grpc.StatusCode.NOT_FOUND
    assert status_code(TransferError("f", "m")) == grpc.StatusCode.UNAVAILABLE


def test_local_message_has_no_addresses():
    groups, _ = model_groups("hybrid", ModelShape())
    cache = allocate_engine("p", groups, 1, 0, tagged=False).cache
    message = engine_to_pb(cache, with_addresses=False)
    assert all(r.address == 0 for g in message.groups for r in g.regions)
