"""The same-host proof (issue #37): only this host's secret and this kernel's boot id make it, for one address."""

from __future__ import annotations

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.groups import DeviceShare, HostShare
from kvxferd.wire import samehost
from kvxferd.wire.challenge import Nonces, new_nonce
from kvxferd.wire.messages import engine_to_pb, peer_memory_from_pb
from kvxferd.rig.verify.buffers import paper_cache
from kvxferd.rig.verify.models import ModelShape, model_groups

SECRET, OTHER_SECRET = b"s" * 32, b"t" * 32
ADDRESS = "127.0.0.1:7001"
NONCES = Nonces(b"c" * 16, b"s" * 16)


def test_a_token_proves_this_host_for_the_address_and_the_challenge_it_names():
    token = samehost.same_host_token(SECRET, ADDRESS, NONCES)
    assert samehost.boot_id() and samehost.is_same_host(SECRET, ADDRESS, NONCES, token)
    assert not samehost.is_same_host(SECRET, "127.0.0.1:7002", NONCES, token)  # another holder's
    assert not samehost.is_same_host(OTHER_SECRET, ADDRESS, NONCES, token)  # another host's secret
    assert not samehost.is_same_host(SECRET, ADDRESS, Nonces(new_nonce(), NONCES.server), token)  # another call's
    assert not samehost.is_same_host(SECRET, ADDRESS, None, token)  # a call that followed no challenge
    assert not samehost.is_same_host(SECRET, ADDRESS, NONCES, "")
    assert not samehost.is_same_host(SECRET, ADDRESS, NONCES, "0" * 64)
    assert not samehost.is_same_host(SECRET, ADDRESS, NONCES, "é" * 64)  # any text fits a protobuf string: no crash


def test_a_token_made_under_another_boot_id_proves_nothing(monkeypatch):
    """A secret copied to another host (or a token from before a reboot) names another kernel."""
    token = samehost.same_host_token(SECRET, ADDRESS, NONCES)
    monkeypatch.setattr(samehost, "boot_id", lambda: "another-boot")
    assert not samehost.is_same_host(SECRET, ADDRESS, NONCES, token)
    assert samehost.is_same_host(SECRET, ADDRESS, NONCES, samehost.same_host_token(SECRET, ADDRESS, NONCES))
    monkeypatch.setattr(samehost, "boot_id", lambda: "")  # no boot id: no proof either way
    assert samehost.same_host_token(SECRET, ADDRESS, NONCES) == ""
    assert not samehost.is_same_host(SECRET, ADDRESS, NONCES, token)


UUID = "GPU-0a1b2c3d-0000-1111-2222-333344445555"


def _shared_cache(gpu: bool = False, by_fd: bool = False):
    groups, _ = model_groups("gqa", ModelShape())
    cache = paper_cache("e", groups, 1, 0)
    share = ((lambda i: DeviceShare(bytes([i + 1]) * 64, 4096 * i, UUID)) if gpu
             else (lambda i: HostShare("", 4096 * i, 5, 77, 4242, 17)) if by_fd
             else (lambda i: HostShare("kv-arena", 4096 * i, 5, 77)))
    memory = tuple(tuple(r.__class__(r.address, r.num_bytes, r.device_id, share(i)) for i, r in enumerate(regions))
                   for regions in cache.memory)
    return cache.__class__(cache.engine_id, cache.tp_size, cache.tp_rank, cache.groups, memory,
                           "VRAM" if gpu else "DRAM")


@pytest.mark.parametrize("gpu,by_fd", [(False, False), (False, True), (True, False)], ids=["shm", "shm-fd", "cuda_ipc"])
def test_shares_go_to_a_proven_reader_only_and_come_back_as_sent(gpu, by_fd):
    cache = _shared_cache(gpu, by_fd)
    plain = peer_memory_from_pb(engine_to_pb(cache, with_addresses=True))
    assert all(r.share is None for regions in plain for r in regions)  # nobody else learns the names
    shared = peer_memory_from_pb(engine_to_pb(cache, with_addresses=True, with_shares=True))
    assert [list(regions) for regions in shared] == [list(regions) for regions in cache.memory]


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", ".", "\x01bad"])
def test_a_name_that_is_not_one_shm_object_is_refused_when_decoded(name):
    message = engine_to_pb(_shared_cache(), with_addresses=True, with_shares=True)
    message.groups[0].regions[0].handle.shm_name = name  # (set even when empty: the oneof names shm_name)
    with pytest.raises(InvalidArgumentError, match="shm_name"):
        peer_memory_from_pb(message)


@pytest.mark.parametrize("field, value, error", [
    ("handle", b"\1" * 63, "64"), ("handle", b"\1" * 66, "64"),  # torch's prefixed form is the engine's, not a peer's
    ("uuid", "", "not a GPU UUID"), ("uuid", "GPU-1234", "not a GPU UUID"), ("uuid", UUID.upper(), "not a GPU UUID"),
    ("offset", -1, "must not be negative")])
def test_a_gpu_share_that_cannot_be_one_is_refused_when_decoded(field, value, error):
    message = engine_to_pb(_shared_cache(gpu=True), with_addresses=True, with_shares=True)
    region = message.groups[0].regions[0]
    if field == "handle":
        region.handle.cuda_ipc_handle = value
    elif field == "uuid":
        region.device_uuid = value
    else:
        region.handle.offset = value
    with pytest.raises(InvalidArgumentError, match=error):
        peer_memory_from_pb(message)


@pytest.mark.parametrize("pid, fd", [(0, 3), (1 << 23, 3), (100, -1), (100, 1 << 30)])
def test_an_fd_share_that_cannot_name_a_process_and_fd_is_refused_when_decoded(pid, fd):
    message = engine_to_pb(_shared_cache(by_fd=True), with_addresses=True, with_shares=True)
    message.groups[0].regions[0].handle.holder_pid = pid
    message.groups[0].regions[0].handle.holder_fd = fd
    with pytest.raises(InvalidArgumentError, match="holder_fd"):
        peer_memory_from_pb(message)


def test_a_gpu_share_never_shows_its_handle_in_a_log_line():
    share = _shared_cache(gpu=True).memory[0][0].share
    assert share.ipc_handle.hex() not in repr(share) and "\\x01" not in repr(share) and UUID in repr(share)


def test_a_reader_keeps_names_only_from_a_holder_that_proved_this_host_too():
    """An engine names the addresses its daemon dials: a listener without the host's secret (another user's)
    must not get the daemon to map an object it names. Only the holder's proof over the reader's own token
    keeps the names: the regions' and the hold board's."""
    import dataclasses

    from kvxferd.plan.board import BoardInfo
    from kvxferd.wire.peerinfo import PeerInfo

    cache = _shared_cache()
    token = samehost.same_host_token(SECRET, ADDRESS, NONCES)
    proof = samehost.holder_proof(SECRET, ADDRESS, token)
    info = PeerInfo("i", b"m", cache, BoardInfo(1 << 20, 64, b"k" * 32, HostShare("", 0, 5, 78, 4242, 18)), proof)
    assert samehost.shares_from(info, SECRET, ADDRESS, token) is info
    for bad_proof, address, request_token, secret in (
            ("", ADDRESS, token, SECRET), ("0" * 64, ADDRESS, token, SECRET),
            (samehost.holder_proof(OTHER_SECRET, ADDRESS, token), ADDRESS, token, SECRET),
            (proof, "127.0.0.1:7002", token, SECRET),  # another listener's answer
            (proof, ADDRESS, samehost.same_host_token(SECRET, "x:1", NONCES), SECRET),
            ("é" * 64, ADDRESS, token, SECRET), (proof, ADDRESS, "", SECRET),
            (proof, ADDRESS, token, None)):  # a reader without the host's secret proves nothing either
        stripped = samehost.shares_from(dataclasses.replace(info, same_host_proof=bad_proof), secret, address,
                                        request_token)
        assert all(r.share is None for regions in stripped.cache.memory for r in regions)
        assert stripped.board.share is None and stripped.board.address == info.board.address
        assert [[r.address for r in regions] for regions in stripped.cache.memory] == [[r.address for r in regions]
                                                                                       for regions in cache.memory]

def test_a_holders_board_share_goes_to_a_proven_reader_only_and_must_be_host_memory():
    """The board's memfd (kvxferd.xfer.boardmemory) travels like the regions' shares: only with a proof,
    decoded as sent, and a GPU handle in its place is refused."""
    from kvxferd.plan.board import BoardInfo
    from kvxferd.proto.v1 import kvxfer_pb2 as pb
    from kvxferd.wire.peerinfo import decode_info, encode_info

    cache = _shared_cache(by_fd=True)
    board = BoardInfo(1 << 20, 64, b"k" * 32, HostShare("", 0, 5, 99, 4242, 23))
    assert decode_info(encode_info("i", b"m", cache, board), cache).board.share is None  # no proof: no share
    decoded = decode_info(encode_info("i", b"m", cache, board, same_host_proof="p" * 64), cache).board
    assert decoded == board
    reply = encode_info("i", b"m", cache, board, same_host_proof="p" * 64)
    info = pb.EngineInfo.FromString(reply.payload)
    info.hold_board.share.cuda_ipc_handle = b"\x01" * 64
    reply.payload = info.SerializeToString()
    with pytest.raises(InvalidArgumentError):
        decode_info(reply, cache)
    info.hold_board.share.shm_fd_index = 0
    info.hold_board.share.holder_pid = 0  # names no process
    reply.payload = info.SerializeToString()
    with pytest.raises(InvalidArgumentError, match="hold_board.share"):
        decode_info(reply, cache)


def test_a_board_share_travels_to_a_reader_worker_as_sent_and_only_as_host_memory():
    """The daemon hands its reader worker each holder's board share as a MemoryHandle (hex), read back with
    the checks a peer's is read with: anything else is refused."""
    from kvxferd.proto.v1 import kvxfer_pb2 as pb
    from kvxferd.wire.messages import host_share_hex
    from kvxferd.worker.reads import _board_share

    share = HostShare("", 0, 5, 78, 4242, 18)
    assert _board_share(host_share_hex(share)) == share and _board_share(None) is None
    gpu = pb.MemoryHandle(cuda_ipc_handle=b"\x01" * 64).SerializeToString().hex()
    no_process = pb.MemoryHandle(shm_fd_index=0, holder_pid=0, holder_fd=3).SerializeToString().hex()
    for bad in ("zz", "ff" * 8, gpu, no_process):
        with pytest.raises(InvalidArgumentError):
            _board_share(bad)
