"""Peer authentication without TLS: a host-local secret that same-host daemons prove on the peer port.

Without mutual TLS the peer port listens on loopback, where any local user
can connect. The daemons of one host share a secret file in their private
runtime directory (0700, the file 0600 or 0640). Every peer call follows a
challenge (:mod:`kvxferd.wire.challenge`): the server proves the secret
over the address it serves and both nonces, and only then does the caller
send its call, with a token bound to that address and those nonces::

    caller dials 127.0.0.1:P       Challenge(c) ──► s, HMAC(secret, "proof" "127.0.0.1:P" c s)
      proof checked, else nothing is sent (and the caller asks the kernel who listens there, to say so)
    call + "c:s" + HMAC(secret, "call" "127.0.0.1:P" c s) ──► s issued here for c and unused? the token
                                                           of ITS advertised address? else UNAUTHENTICATED

The token names the exact address dialed (the daemon takes only the
address it advertises, no alias such as ``[::1]`` or ``localhost`` that
another user could bind) and one server nonce of one incarnation, used
once: a listener that squats a port gets no token, and a token captured
any other way opens nothing.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat

import grpc

from kvxferd.errors import PermissionDeniedError, UnauthenticatedError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
from kvxferd.wire.challenge import (CHALLENGE_KEY, ChallengeBook, Nonces, call_token, new_nonce, proof_matches)
from kvxferd.wire.listening import listener_uids
from kvxferd.wire.names import default_runtime_dir
from kvxferd.wire.peerinfo import PROTOCOL_VERSION

PEER_TOKEN_KEY = "kvxferd-peer-token"  # gRPC metadata of every peer call when TLS is off
PEER_SECRET_NAME = "peer.secret"
SECRET_BYTES = 32


def default_peer_secret_file(runtime_dir: str | None = None) -> str:
    """Where the daemons of one user and host share their peer secret: ``<runtime_dir>/peer.secret``."""
    return os.path.join(runtime_dir or default_runtime_dir(), PEER_SECRET_NAME)


def read_peer_secret(path: str) -> bytes:
    """The secret in ``path``: a regular file (not a link) of this user or root that others cannot read or
    anyone but its owner write. Raises :class:`PermissionDeniedError` naming what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise PermissionDeniedError("peer_secret_file", f"cannot open {path}: {err.strerror} (a symlink?)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionDeniedError("peer_secret_file", f"{path} is not a regular file")
        if info.st_uid not in (os.getuid(), 0):
            raise PermissionDeniedError("peer_secret_file", f"{path} belongs to uid {info.st_uid}, not to this "
                                                            f"user ({os.getuid()}) or root")
        if info.st_mode & 0o027:
            raise PermissionDeniedError("peer_secret_file", f"{path} has mode {stat.S_IMODE(info.st_mode):o}: others "
                                                            "may read or its group write it (use 0600 or 0640)")
        text = os.read(fd, 4 * SECRET_BYTES + 2).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < SECRET_BYTES:
        raise PermissionDeniedError("peer_secret_file", f"{path} does not hold a secret of {SECRET_BYTES} or more "
                                                        "bytes in hex (delete it: the next daemon writes a new one)")
    return secret


def load_or_create_peer_secret(path: str) -> bytes:
    """The host's peer secret, written first (0600, atomically: racing daemons agree) when there is none."""
    try:
        return read_peer_secret(path)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    scratch = os.path.join(directory, f".{PEER_SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(scratch, path)  # never replaces: a daemon that won the race keeps its secret
    except FileExistsError:
        pass
    finally:
        os.unlink(scratch)
    return read_peer_secret(path)


def tokens_match(expected: str, presented: str) -> bool:
    """``presented`` is ``expected`` (a token: 64 hex digits), compared in constant time. Anything else is
    False, not an error: a protobuf string may hold any text, and ``compare_digest`` takes ASCII only."""
    return len(presented) == len(expected) and presented.isascii() and hmac.compare_digest(expected, presented)


def check_peer_call(secret: bytes, address: str, book: ChallengeBook, challenge: str, presented: str) -> Nonces:
    """The nonces of a call to this daemon (advertised at ``address``), used up; raises
    :class:`UnauthenticatedError` unless the call follows a challenge issued here and presents its token."""
    if not presented:
        raise UnauthenticatedError("peer", "no peer token: this port takes same-host daemons that share its "
                                           "peer secret (peer_secret_file), or mutual TLS")
    nonces = Nonces.parse(challenge)
    if not tokens_match(call_token(secret, address, nonces), presented):
        raise UnauthenticatedError("peer", "the peer token is not this daemon's (another host secret, or a token "
                                           "for another address)")
    book.take(nonces)  # last: only an authenticated call is remembered
    return nonces


def refuse_listener(address: str, why: str) -> PermissionDeniedError:
    """The error for a server at ``address`` that failed its challenge, naming the uid listening there
    when the kernel can tell (a local user's listener in a daemon's place)."""
    host, _, port = address.rpartition(":")
    owners = listener_uids(host, int(port)) if port.isdigit() else None
    strangers = (owners or set()) - {os.getuid(), 0}
    who = f"served by uid {min(strangers)}, not" if strangers else "not"
    return PermissionDeniedError("peer_addresses", f"{address} is {who} a daemon of this host: {why}; nothing "
                                                   "secret was sent to it")


def secret_call_metadata(secret: bytes, address: str, nonces: Nonces) -> tuple[tuple[str, str], ...]:
    """The metadata of a call to ``address`` after its server passed the challenge ``nonces``."""
    return ((CHALLENGE_KEY, nonces.text()), (PEER_TOKEN_KEY, call_token(secret, address, nonces)))


def prove_secret(stub: peer_grpc.PeerServiceStub, secret: bytes, address: str, timeout_s: float = 10.0) -> Nonces:
    """Challenge the server at ``address`` (synchronous stub: tools and tests); its nonces once it proved
    the host secret, else :class:`PermissionDeniedError` (nothing secret was sent)."""
    client = new_nonce()
    reply = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=client),
                           timeout=timeout_s)
    nonces = Nonces(client, bytes(reply.server_nonce))
    if not proof_matches(secret, address, nonces, reply.proof):
        raise refuse_listener(address, "its challenge proof is not this host's peer secret")
    return nonces


class _ChallengeInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, channel: grpc.Channel, secret: bytes, address: str) -> None:
        self.stub, self.secret, self.address = peer_grpc.PeerServiceStub(channel), secret, address

    def intercept_unary_unary(self, continuation, details, request):
        nonces = prove_secret(self.stub, self.secret, self.address)
        metadata = tuple(details.metadata or ()) + secret_call_metadata(self.secret, self.address, nonces)
        return continuation(details._replace(metadata=metadata), request)


def peer_channel(address: str, secret_file: str | None = None) -> grpc.Channel:
    """A plaintext channel to a same-host daemon's peer port whose every call follows a challenge the
    daemon passed, with its token (tools, tests)."""
    secret = read_peer_secret(secret_file or default_peer_secret_file())
    channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _ChallengeInterceptor(channel, secret, address))
