"""Issue 61: the formats of docs/protocol.md's "Formats, byte for byte", built from that text alone.

The builders below (``docs_*``) use only the standard library: they are what
a second implementation would write from the docs. Each is checked against
kvxferd's own code and, where a daemon takes the format, against real
daemons: a raw peer call (challenge, proof, call token), the same-host token
and the holder's proof, and a read carrying a capability built here. One
byte changed is refused (or, where the docs say so, means something else).
kvxferd code in this file only runs the daemons, speaks gRPC (the stubs
generated from protos/) and is the reference the builders are checked
against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import shutil
import struct
import tempfile

import grpc
import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan import board, capability, notifications
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire import challenge, peerauth, samehost

# ---- builders: the docs' text, standard library only -------------------------------------------------

PROTOCOL_VERSION = 7


def docs_peer_secret(path: str) -> bytes:
    """The key: the bytes the hex in the file encodes, its trailing newline left out."""
    with open(path, "rb") as file:
        text = file.read()
    assert text.endswith(b"\n") and len(text) == 65, text  # 64 hex digits and a newline, as a daemon writes it
    return bytes.fromhex(text[:-1].decode("ascii"))


def docs_mac(secret: bytes, context: str, subject: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 over context, NUL, subject (UTF-8), NUL, client nonce, server nonce."""
    message = context.encode() + b"\0" + subject.encode() + b"\0" + client_nonce + server_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def docs_challenge_proof(secret: bytes, address: str, c: bytes, s: bytes) -> bytes:
    return docs_mac(secret, "kvxferd-peer-proof-v1", address, c, s)  # raw 32 bytes in ChallengeReply.proof


def docs_call_metadata(secret: bytes, address: str, c: bytes, s: bytes) -> tuple[tuple[str, str], ...]:
    return (("kvxferd-peer-challenge", f"{c.hex()}:{s.hex()}"),
            ("kvxferd-peer-token", docs_mac(secret, "kvxferd-peer-call-v1", address, c, s).hex()))


def docs_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as file:
        return file.read().strip()


def docs_same_host_token(secret: bytes, boot_id: str, address: str, c: bytes, s: bytes) -> str:
    return docs_mac(secret, "kvxferd-same-host-v2", f"{boot_id}/{address}", c, s).hex()


def docs_holder_proof(secret: bytes, boot_id: str, address: str, token: str) -> str:
    return docs_mac(secret, "kvxferd-same-host-holder-v2", f"{boot_id}/{address}/{token}", b"", b"").hex()


def docs_capability(hold_key: bytes, request_id: str, block_ids) -> bytes:
    key_id = hashlib.blake2b(hold_key, digest_size=4, person=b"kvxferd-keyid-v1").digest()
    mac = hashlib.blake2b(key=hold_key, digest_size=12, person=b"kvxferd-hold-v1")
    rid = request_id.encode("utf-8")
    mac.update(struct.pack("<II", len(rid), len(block_ids)) + rid)
    for ids in block_ids:
        ids = [int(i) for i in ids]
        mac.update(struct.pack(f"<I{len(ids)}q", len(ids), *ids))
    return key_id + mac.digest()


def docs_notice(request_id: str, reader_engine_id: str, reader_rank: int, expected: int, cap: bytes, *,
                ok: bool = True, alone: bool = False) -> bytes:
    rid, eid = request_id.encode(), reader_engine_id.encode()
    flags = (1 if ok else 0) | (2 if alone else 0)
    return struct.pack("<2sBBHHHH16s", b"KN", 2, flags, reader_rank, expected, len(rid), len(eid), cap) + rid + eid


DOCS_HELLO = b"KH\x01"


def docs_board_tag(cap: bytes) -> int:
    tag = int.from_bytes(hashlib.blake2b(cap, digest_size=8, person=b"kvxferd-tag-v1").digest(), "little")
    return tag or 1


def docs_buckets(tag: int, num_buckets: int) -> tuple[int, int]:
    first, second = tag & (num_buckets - 1), (tag >> 32) & (num_buckets - 1)
    return first, (first ^ 1 if second == first else second)


def docs_tag_on_board(board_bytes: bytes, cap: bytes, num_buckets: int) -> bool:
    """What a reader does with the two 64-byte buckets it READ (here: taken from the whole board's bytes)."""
    tag = docs_board_tag(cap)
    for bucket in docs_buckets(tag, num_buckets):
        if tag in struct.unpack_from("<8Q", board_bytes, 64 * bucket):
            return True
    return False


def agent_metadata(name: str) -> bytes:
    """The header of NIXL's agent metadata: all a holder reads of a reader's introduction (its name)."""
    raw = name.encode()
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(raw)) + raw + b"|"


def flip(data, index: int):
    """``data`` (bytes or hex text) with one byte (one hex digit) changed."""
    if isinstance(data, str):
        return data[:index] + ("0" if data[index] != "0" else "1") + data[index + 1:]
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


# ---- the daemons ------------------------------------------------------------------------------------------

GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster():
    workdir = tempfile.mkdtemp(prefix="kvf")
    secret_file = os.path.join(workdir, "peer.secret")  # written by the first daemon, as documented
    try:
        with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="fmt",
                           daemon_args=("--peer-secret-file", secret_file)) as c:
            c.secret_file = secret_file
            yield c
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def peer(cluster):
    address = cluster.prefill_daemons[0].peer_address
    with grpc.insecure_channel(address) as channel:
        yield address, peer_grpc.PeerServiceStub(channel), docs_peer_secret(cluster.secret_file)


def challenge_of(stub, secret: bytes, address: str) -> tuple[bytes, bytes]:
    """A Challenge, its proof checked as the docs say; the nonces."""
    c = secrets.token_bytes(16)
    reply = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=c), timeout=10)
    s = bytes(reply.server_nonce)
    assert len(s) == 16 and reply.protocol_version == PROTOCOL_VERSION and not reply.certificate
    assert hmac.compare_digest(bytes(reply.proof), docs_challenge_proof(secret, address, c, s))
    assert bytes(reply.proof) != docs_challenge_proof(secret, flip(address, len(address) - 1), c, s)
    return c, s


def engine_info(cluster, stub, metadata, same_host_token: str = "") -> pb.EngineInfo:
    reply = stub.GetEngineInfo(pb.EngineInfoRequest(
        engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id="docs-reader",
        reader_tp_rank=0, reader_tp_size=1, reader_agent_metadata=agent_metadata("docs-reader-notices"),
        same_host_token=same_host_token), metadata=metadata, timeout=10)
    assert reply.protocol_version == PROTOCOL_VERSION
    info = pb.EngineInfo()
    info.ParseFromString(reply.payload)
    return info


def shm_names(info: pb.EngineInfo) -> set[str]:
    return {r.handle.shm_name for g in info.engine.groups for r in g.regions}


# ---- the tests --------------------------------------------------------------------------------------------

@pytest.mark.daemons
def test_the_peer_secret_file_is_hex_and_a_newline_and_the_key_is_the_bytes_it_encodes(cluster):
    key = docs_peer_secret(cluster.secret_file)
    assert len(key) == 32 and key == peerauth.read_peer_secret(cluster.secret_file)


@pytest.mark.daemons
def test_a_raw_peer_call_built_from_the_docs_is_answered_and_one_byte_changed_is_refused(cluster, peer):
    address, stub, secret = peer
    c, s = challenge_of(stub, secret, address)
    metadata = docs_call_metadata(secret, address, c, s)
    nonces = challenge.Nonces(c, s)  # the reference implementation agrees byte for byte
    assert bytes(challenge.secret_proof(secret, address, nonces)) == docs_challenge_proof(secret, address, c, s)
    assert metadata == peerauth.secret_call_metadata(secret, address, nonces)
    info = engine_info(cluster, stub, metadata)
    assert len(info.hold_key) == 32
    with pytest.raises(grpc.RpcError) as again:  # a server nonce is taken once
        engine_info(cluster, stub, metadata)
    assert again.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (challenge_key, nonces_text), (token_key, token) = metadata
    for changed in (lambda nt, t: (flip(nt, 5), t),  # the client nonce
                    lambda nt, t: (flip(nt, len(nt) - 1), t),  # the server nonce
                    lambda nt, t: (nt, flip(t, 7))):  # the call token
        c, s = challenge_of(stub, secret, address)
        (_, nonces_text), (_, token) = docs_call_metadata(secret, address, c, s)
        nonces_text, token = changed(nonces_text, token)
        with pytest.raises(grpc.RpcError) as refused:
            engine_info(cluster, stub, ((challenge_key, nonces_text), (token_key, token)))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
    c, s = challenge_of(stub, secret, address)  # the control: a fresh challenge and its token are answered
    assert engine_info(cluster, stub, docs_call_metadata(secret, address, c, s)).hold_key == info.hold_key


@pytest.mark.daemons
def test_the_same_host_token_and_the_holders_proof_built_from_the_docs(cluster, peer):
    address, stub, secret = peer
    boot = docs_boot_id()
    assert boot and boot == samehost.boot_id()
    c, s = challenge_of(stub, secret, address)
    token = docs_same_host_token(secret, boot, address, c, s)
    assert token == samehost.same_host_token(secret, address, challenge.Nonces(c, s))
    assert docs_holder_proof(secret, boot, address, token) == samehost.holder_proof(secret, address, token)
    info = engine_info(cluster, stub, docs_call_metadata(secret, address, c, s), token)
    assert shm_names(info) == {cluster.arenas[0].name}  # the holder names its shared memory
    assert info.same_host_proof == docs_holder_proof(secret, boot, address, token)
    assert info.same_host_proof != docs_holder_proof(secret, boot, address, flip(token, 3))
    for index in (0, 31, 63):  # one hex digit of the token changed: addresses only, no proof
        c, s = challenge_of(stub, secret, address)
        info = engine_info(cluster, stub, docs_call_metadata(secret, address, c, s),
                           flip(docs_same_host_token(secret, boot, address, c, s), index))
        assert shm_names(info) == {""} and info.same_host_proof == ""


@pytest.mark.daemons
def test_the_capability_built_from_the_docs_matches_the_holders_and_opens_exactly_its_read(cluster, peer):
    address, stub, secret = peer
    rng = np.random.default_rng(61)
    for _ in range(20):  # against the reference with known keys: empty groups, ids past 2**32, UTF-8 ids
        key = rng.bytes(32)
        blocks = [rng.integers(0, 2**40, size=rng.integers(0, 5)).tolist() for _ in range(rng.integers(1, 4))]
        assert docs_capability(key, "réq-1", blocks) == capability.hold_capability(key, "réq-1", blocks)
    c, s = challenge_of(stub, secret, address)
    hold_key = engine_info(cluster, stub, docs_call_metadata(secret, address, c, s)).hold_key
    request = random_request("docs-cap", *GROUPS, 70, rng)
    held = cluster.hold(request)  # HoldReply.capability
    built = docs_capability(hold_key, request.remote_request_id, request.remote_block_ids)
    assert held == (built,)
    cluster.reset_decode()
    completion, = cluster.read(dataclasses.replace(request, remote_capabilities=(built,)), hold=False)
    assert completion.ok, completion.error
    assert cluster.verify(request) == ([], 0)
    for index in (0, 15):  # one byte of the key id, one of the MAC
        other = random_request(f"docs-cap-{index}", *GROUPS, 70, rng)
        cluster.hold(other)
        cluster.reset_decode()
        forged = flip(docs_capability(hold_key, other.remote_request_id, other.remote_block_ids), index)
        completion, = cluster.read(dataclasses.replace(other, remote_capabilities=(forged,)), hold=False)
        assert completion.refused_code == grpc.StatusCode.PERMISSION_DENIED.value[0], completion
        assert "remote_capabilities" in completion.error and cluster.decode_untouched()
        cluster.prefill_clients[0].release(other.remote_request_id)


def test_the_notice_record_built_from_the_docs_is_what_the_holder_decodes():
    cap = bytes(range(16))
    for ok, alone in ((True, False), (False, True), (True, True)):
        record = docs_notice("req-7", "décode", 3, 2, cap, ok=ok, alone=alone)
        reference = notifications.ReadNotice("req-7", "décode", 3, 2, ok, alone, cap)
        assert record == reference.encode() and notifications.ReadNotice.decode(record) == reference
    assert DOCS_HELLO == notifications.HELLO
    record = docs_notice("req-7", "decode", 0, 1, cap)
    refused = {0: "magic", 2: "version", 3: "flags (bit 2)", 6: "expected_readers (1 -> 0)", 8: "len(request_id)",
               10: "len(reader_engine_id)"}
    for offset, what in refused.items():
        changed = record[:offset] + bytes([record[offset] ^ (0x04 if offset == 3 else 0x01)]) + record[offset + 1:]
        with pytest.raises(InvalidArgumentError):
            notifications.ReadNotice.decode(changed)
            pytest.fail(f"a changed {what} was taken")
    with pytest.raises(InvalidArgumentError):  # a byte after the ids
        notifications.ReadNotice.decode(record + b"x")
    # Bytes that decode to another meaning: the holder then finds another reader, hold or capability.
    assert notifications.ReadNotice.decode(flip(record, 4)).reader_rank == 1
    assert notifications.ReadNotice.decode(flip(record, 12)).capability == flip(cap, 0)
    assert notifications.ReadNotice.decode(flip(record, 28)).request_id == "seq-7"


def test_the_board_tag_and_buckets_built_from_the_docs_find_a_hold_on_a_holders_board():
    rng = np.random.default_rng(5)
    hold_board = board.HoldBoard(board.buckets_for(64))
    caps = [rng.bytes(16) for _ in range(40)]
    for cap in caps:
        tag = docs_board_tag(cap)
        assert tag == board.hold_tag(cap)
        for n in (2, 4, 1024, 1 << 24):
            assert docs_buckets(tag, n) == board.bucket_pair(tag, n)
        hold_board.add(tag)
    words = hold_board.words.tobytes()
    assert all(docs_tag_on_board(words, cap, hold_board.num_buckets) for cap in caps)
    hold_board.remove(board.hold_tag(caps[0]))
    words = hold_board.words.tobytes()
    assert not docs_tag_on_board(words, caps[0], hold_board.num_buckets)
    assert not docs_tag_on_board(words, flip(caps[1], 0), hold_board.num_buckets)
    assert docs_tag_on_board(words, caps[1], hold_board.num_buckets)


@pytest.mark.daemons
def test_a_read_both_malformed_and_unsealed_gets_the_refusal_the_docs_give(cluster):
    """A read checks the block ids before the capabilities, except a read over what its batch may still post
    on the loop (1 MiB), planned on the data-plane thread, checked the other way round (docs: the order
    of a read's checks)."""
    rng = np.random.default_rng(62)
    client = cluster.decode_clients[0]
    for tokens, name in ((70, "small"), (640, "large")):  # 5 blocks (160 KiB), 40 blocks (1.25 MiB)
        request = random_request(f"order-{name}", *GROUPS, tokens, rng)
        real, = cluster.hold(request)
        forged = flip(real, 15)
        bad_local = [list(ids[:-1]) + [GROUPS[1][0].spec.num_blocks] for ids in request.local_block_ids]

        def submit(local, cap, suffix: str) -> int:
            """The refused completion's code of the read, alone in its batch."""
            args = (f"{request.request_id}-{suffix}", cluster.prefill_id, request.remote_request_id, local,
                    request.remote_block_ids)
            client.reads.submit_reads([client.read_spec(*args, remote_capabilities=(cap,))])
            return client.reads.wait_completion(args[0], 10).refused_code
        assert submit(bad_local, forged, "both") == (
            grpc.StatusCode.INVALID_ARGUMENT if name == "small" else grpc.StatusCode.PERMISSION_DENIED).value[0]
        # A capability under a key id the link does not know (a restarted holder, or made up): the same order.
        assert submit(bad_local, flip(real, 0), "both-unknown-key") == (
            grpc.StatusCode.INVALID_ARGUMENT if name == "small" else grpc.StatusCode.PERMISSION_DENIED).value[0]
        assert submit(request.local_block_ids, forged, "unsealed") == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert submit(bad_local, real, "malformed") == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        cluster.prefill_clients[0].release(request.remote_request_id)


class _EnvelopePeer(peer_grpc.PeerServiceServicer):
    """A peer written from the docs: proves itself as a daemon of the host would (the docs' challenge
    proof), and answers every engine info with ``compatibility_hash`` and an empty payload."""

    def __init__(self, secret: bytes) -> None:
        self.secret, self.address, self.compatibility_hash = secret, "", ""

    def Challenge(self, request, context):
        s = secrets.token_bytes(16)
        return pb.ChallengeReply(protocol_version=PROTOCOL_VERSION, server_nonce=s,
                                 proof=docs_challenge_proof(self.secret, self.address, request.client_nonce, s))

    def GetEngineInfo(self, request, context):
        return pb.EngineInfoReply(protocol_version=PROTOCOL_VERSION, compatibility_hash=self.compatibility_hash,
                                  payload=b"")


@pytest.mark.daemons
def test_a_peer_reply_is_judged_by_its_envelope_before_its_payload(cluster, peer):
    """Issue 61, item 2: another model's hash with an empty payload is FAILED_PRECONDITION naming the hash
    (the envelope first), where the right hash with the same empty payload gets the payload's refusal."""
    from concurrent.futures import ThreadPoolExecutor

    address, stub, secret = peer
    c, s = challenge_of(stub, secret, address)
    real = stub.GetEngineInfo(pb.EngineInfoRequest(
        engine_id=cluster.prefill_id, protocol_version=PROTOCOL_VERSION, tp_rank=0, reader_engine_id="docs-reader",
        reader_tp_rank=0, reader_tp_size=1, reader_agent_metadata=agent_metadata("docs-reader-notices")),
        metadata=docs_call_metadata(secret, address, c, s), timeout=10).compatibility_hash
    fake = _EnvelopePeer(secret)
    server = grpc.server(ThreadPoolExecutor(2))
    peer_grpc.add_PeerServiceServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        seen = {}
        for name, hash_ in (("another model", flip(real, 3)), ("this model", real)):
            fake.compatibility_hash = hash_
            with pytest.raises(grpc.RpcError) as refused:
                cluster.decode_clients[0].handshake(f"envelope-{name.split()[0]}", [fake.address])
            seen[name] = (refused.value.code(), refused.value.details())
    finally:
        server.stop(None)
    assert seen["another model"][0] == grpc.StatusCode.FAILED_PRECONDITION, seen
    assert "compatibility_hash" in seen["another model"][1], seen
    # The control: the same empty payload under the right hash passes the envelope and is refused for itself.
    assert seen["this model"][0] == grpc.StatusCode.INVALID_ARGUMENT and "compatibility_hash" not in seen["this model"][1]
