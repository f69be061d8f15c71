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
MAX_PENDING = 4096  # server nonces issued and not yet taken; the oldest goes first (a flood only evicts)
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
    """Server nonces issued and not yet used (thread-safe): each is good for one call within its TTL.

    Kept in memory only: a restarted daemon takes none of the nonces its
    predecessor issued, so a token made for one is worthless after it.
    """

    def __init__(self, *, ttl_s: float = CHALLENGE_TTL_S, max_pending: int = MAX_PENDING) -> None:
        self.ttl_s, self.max_pending = ttl_s, max_pending
        self._pending: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def issue(self, client_nonce: bytes, now: float | None = None) -> Nonces:
        """A new server nonce for ``client_nonce`` (``NONCE_BYTES`` long, checked by the caller)."""
        nonces = Nonces(bytes(client_nonce), new_nonce())
        with self._lock:
            while len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
            self._pending[nonces.server] = (nonces.client, (time.monotonic() if now is None else now) + self.ttl_s)
        return nonces

    def take(self, nonces: Nonces, now: float | None = None) -> None:
        """Use up ``nonces``; raises :class:`UnauthenticatedError` unless issued here, unused and in time."""
        with self._lock:
            entry = self._pending.pop(nonces.server, None)
        if entry is None or not hmac.compare_digest(entry[0], nonces.client):
            raise UnauthenticatedError("peer", "a challenge this daemon did not issue, or one already used")
        if (time.monotonic() if now is None else now) > entry[1]:
            raise UnauthenticatedError("peer", f"the challenge is older than {self.ttl_s:g} s")

    def __len__(self) -> int:
        return len(self._pending)
