"""Who answers at a peer address: a challenge before anything secret is sent (protocol 7, issue #53).

A daemon dials addresses an engine names (``Handshake.peer_addresses``,
from an HTTP client's ``kv_transfer_params`` through vLLM), and gRPC
reconnects by itself: whoever listens there when the bytes go out gets
them. So every peer exchange starts with a challenge that the answering
daemon must pass before the caller sends a token, a same-host token or its
notice agent's metadata::

    caller                                         server at ADDRESS
    Challenge(client nonce c)          ──────►     server nonce s (kept 30 s, taken once)
                                       ◄──────     proof: no TLS  HMAC(secret, "proof" ADDRESS c s)
                                                          TLS     signature of (c s) by its certificate's key
    proof checked (else nothing more is sent)
    call + metadata "c:s", token = HMAC(secret, "call" ADDRESS c s)   (no TLS)
                                       ──────►     s issued here for c, not taken yet? token of ITS address?

A listener that squats a restarting daemon's port cannot make the proof
(it lacks the host secret, or an allowed certificate's key), so it gets a
nonce and nothing else. A token is bound to one server nonce of one
incarnation of the server, taken on first use: captured, it opens nothing.
Checking the listener's uid before connecting (issue #35) could not see a
listener swapped in between the check and gRPC's (re)connect; the proof is
made by whoever answers.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from kvxferd.errors import UnauthenticatedError

CHALLENGE_KEY = "kvxferd-peer-challenge"  # gRPC metadata of a call after a challenge: "<c hex>:<s hex>"
NONCE_BYTES = 16
CHALLENGE_TTL_S = 30.0  # a server nonce must be used within this
MAX_USED = 65536  # server nonces used within their TTL, remembered against replay (authenticated calls only)
_PROOF = b"kvxferd-peer-proof-v1\0"
_CALL = b"kvxferd-peer-call-v1\0"
_SIGNED = b"kvxferd-peer-signed-v1\0"


@dataclass(frozen=True)
class Nonces:
    """One challenge: the caller's nonce and the server's answer to it."""

    client: bytes
    server: bytes

    def text(self) -> str:
        """As the ``kvxferd-peer-challenge`` metadata carries it."""
        return f"{self.client.hex()}:{self.server.hex()}"

    @classmethod
    def parse(cls, text: str) -> "Nonces":
        """From metadata; raises :class:`UnauthenticatedError` for anything but two nonces in hex."""
        client, _, server = text.partition(":")
        try:
            nonces = cls(bytes.fromhex(client), bytes.fromhex(server))
        except ValueError:
            nonces = None
        if nonces is None or len(nonces.client) != NONCE_BYTES or len(nonces.server) != NONCE_BYTES:
            raise UnauthenticatedError("peer", f"no challenge: every peer call needs the nonces of a Challenge "
                                               f"({CHALLENGE_KEY} metadata)")
        return nonces


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def bound_mac(secret: bytes, context: bytes, subject: str, nonces: Nonces) -> bytes:
    """HMAC-SHA256 of ``secret`` over a context, a subject (an address) and one challenge's nonces."""
    return hmac.new(secret, context + subject.encode() + b"\0" + nonces.client + nonces.server, hashlib.sha256).digest()


def secret_proof(secret: bytes, address: str, nonces: Nonces) -> bytes:
    """What a server that holds the host secret answers a challenge with, serving ``address``."""
    return bound_mac(secret, _PROOF, address, nonces)


def proof_matches(secret: bytes, address: str, nonces: Nonces, proof: bytes) -> bool:
    """Whether ``proof`` is :func:`secret_proof` of the address the caller dialed (constant time)."""
    return hmac.compare_digest(secret_proof(secret, address, nonces), bytes(proof))


def call_token(secret: bytes, address: str, nonces: Nonces) -> str:
    """The token a caller presents with the call that follows a challenge passed at ``address``."""
    return bound_mac(secret, _CALL, address, nonces).hex()


def signed_message(nonces: Nonces) -> bytes:
    """What a TLS server signs with its certificate's key to answer a challenge."""
    return _SIGNED + nonces.client + nonces.server


class ChallengeBook:
    """Server nonces: made without state, each good for one call within its TTL (thread-safe).

    A server nonce is the time it was issued and a MAC over it and the
    client nonce, keyed by this process alone::

        server nonce (16 bytes) = issued_ms (6, big-endian, this process's monotonic clock)
                                  + HMAC-SHA256(process key, client nonce + issued_ms)[:10]

    So issuing stores nothing: anyone may call Challenge (without TLS, any
    local user), and a flood of challenges evicts nobody's. Only a call that
    presented a valid token is remembered (until its nonce's TTL ends), so a
    nonce is taken once; only authenticated callers add to that. A restarted
    daemon has another key and takes none of its predecessor's nonces.
    """

    def __init__(self, *, ttl_s: float = CHALLENGE_TTL_S, max_used: int = MAX_USED) -> None:
        self.ttl_s, self.max_used = ttl_s, max_used
        self._key = secrets.token_bytes(32)
        self._used: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonce -> when it expires
        self._lock = threading.Lock()

    @staticmethod
    def _now_ms(now: float | None) -> int:
        return int((time.monotonic() if now is None else now) * 1000)

    def _mac(self, client_nonce: bytes, issued: bytes) -> bytes:
        return hmac.new(self._key, bytes(client_nonce) + issued, hashlib.sha256).digest()[:NONCE_BYTES - 6]

    def issue(self, client_nonce: bytes, now: float | None = None) -> Nonces:
        """A new server nonce for ``client_nonce`` (``NONCE_BYTES`` long, checked by the caller)."""
        issued = self._now_ms(now).to_bytes(6, "big")
        return Nonces(bytes(client_nonce), issued + self._mac(client_nonce, issued))

    def take(self, nonces: Nonces, now: float | None = None) -> None:
        """Use up ``nonces``; raises :class:`UnauthenticatedError` unless issued here, unused and in time.
        Call it only once the rest of the call's credentials checked out (see :func:`check_peer_call`)."""
        issued, mac = nonces.server[:6], nonces.server[6:]
        if not hmac.compare_digest(self._mac(nonces.client, issued), mac):
            raise UnauthenticatedError("peer", "a challenge this daemon did not issue")
        now_ms = self._now_ms(now)
        if now_ms - int.from_bytes(issued, "big") > self.ttl_s * 1000:
            raise UnauthenticatedError("peer", f"the challenge is older than {self.ttl_s:g} s")
        with self._lock:
            while self._used and next(iter(self._used.values())) < now_ms:  # expired: a replay fails on time
                self._used.popitem(last=False)
            if nonces.server in self._used:
                raise UnauthenticatedError("peer", "a challenge already used")
            if len(self._used) >= self.max_used:  # more authenticated calls in a TTL than this: forget the oldest
                self._used.popitem(last=False)
            self._used[nonces.server] = int.from_bytes(issued, "big") + self.ttl_s * 1000

    def __len__(self) -> int:
        return len(self._used)
