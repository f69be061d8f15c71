"""Peer authentication without TLS: a host-local secret that same-host daemons present on the peer port.

Without mutual TLS the peer port listens on loopback, where any local user
can connect. The daemons of one host share a secret file in their private
runtime directory (0700, the file 0600 or 0640); a peer call carries a token
derived from the secret, the address the caller dialed and the current
five-minute window::

    caller dials 127.0.0.1:P      token = HMAC-SHA256(secret, "kvxferd-peer-v2\0" + "127.0.0.1:P" + "\0" + window)
      (only if every listener        window = unix time // 300
       on P runs as its own uid     ──► daemon on 127.0.0.1:P: the token of its own address, this window or the
       or root: wire/listening.py)        last? else UNAUTHENTICATED, before anything is looked up

Engines name the addresses a daemon dials (``Handshake.peer_addresses``),
so a local user could get a daemon to dial its own listener. Three things
keep that from opening a real daemon's port: the caller sends a token only
to a loopback listener of its own user (or root); the token names the exact
address dialed (the daemon takes only the address it advertises, no alias
such as ``[::1]`` or ``localhost`` that another user could bind); and it
expires within ten minutes. The token is sent in the clear over loopback,
which only root can watch.

Nothing here authenticates the answering daemon beyond its uid (TLS does
that); docs/security.md says what that leaves open.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
import time

import grpc

from kvxferd.errors import PermissionDeniedError, UnauthenticatedError
from kvxferd.wire.listening import listener_uids
from kvxferd.wire.names import default_runtime_dir

PEER_TOKEN_KEY = "kvxferd-peer-token"  # gRPC metadata of every peer call when TLS is off
PEER_SECRET_NAME = "peer.secret"
SECRET_BYTES = 32
TOKEN_WINDOW_S = 300  # a token is taken in its window and the next: captured, it is worth ten minutes at most
_CONTEXT = b"kvxferd-peer-v2\0"


def default_peer_secret_file(runtime_dir: str | None = None) -> str:
    """Where the daemons of one user and host share their peer secret: ``<runtime_dir>/peer.secret``."""
    return os.path.join(runtime_dir or default_runtime_dir(), PEER_SECRET_NAME)


def token_window(now: float | None = None) -> int:
    """The window a token made at ``now`` (unix seconds) belongs to."""
    return int((time.time() if now is None else now) // TOKEN_WINDOW_S)


@functools.lru_cache(maxsize=256)
def peer_token(secret: bytes, address: str, window: int) -> str:
    """The token a caller presents when it dials ``address`` (host:port as dialed) in ``window``."""
    return hmac.new(secret, _CONTEXT + address.encode() + b"\0" + str(window).encode(), hashlib.sha256).hexdigest()


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


def check_peer_token(secret: bytes, address: str, presented: str, now: float | None = None) -> None:
    """Raises :class:`UnauthenticatedError` unless ``presented`` is the token of ``address`` (this daemon's
    advertised address) in this window or the one before."""
    if not presented:
        raise UnauthenticatedError("peer", "no peer token: this port takes same-host daemons that share its "
                                           "peer secret (peer_secret_file), or mutual TLS")
    window = token_window(now)
    if not any(tokens_match(peer_token(secret, address, w), presented) for w in (window, window - 1)):
        raise UnauthenticatedError("peer", "the peer token is not this daemon's (another host secret, a token for "
                                           "another address, or an old one)")


def peer_metadata(secret: bytes, address: str, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of one peer call to ``address``: its token, after checking that a loopback listener there
    runs as this user or root (else :class:`PermissionDeniedError`: the token is not handed to another user)."""
    host, _, port = address.rpartition(":")
    owners = listener_uids(host, int(port)) if port.isdigit() else None
    strangers = (owners or set()) - {os.getuid(), 0}
    if strangers:
        raise PermissionDeniedError("peer_addresses", f"{address} is served by uid {min(strangers)}, not by a "
                                                      "daemon of this user: no peer token is sent to it")
    return ((PEER_TOKEN_KEY, peer_token(secret, address, token_window(now))),)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, secret: bytes, address: str) -> None:
        self.secret, self.address = secret, address

    def intercept_unary_unary(self, continuation, details, request):
        metadata = tuple(details.metadata or ()) + peer_metadata(self.secret, self.address)
        return continuation(details._replace(metadata=metadata), request)


def peer_channel(address: str, secret_file: str | None = None) -> grpc.Channel:
    """A plaintext channel to a same-host daemon's peer port that presents this host's token (tools, tests)."""
    secret = read_peer_secret(secret_file or default_peer_secret_file())
    return grpc.intercept_channel(grpc.insecure_channel(address), _TokenInterceptor(secret, address))
