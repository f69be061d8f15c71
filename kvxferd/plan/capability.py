"""Read capabilities: a holder's proof that it holds exactly these blocks for this request.

A read names a remote request and its blocks, and those names come from the
engine (through vLLM, from an HTTP request). Without a check a client could
name blocks of another tenant's request under a request id that is held, and
the reader would copy them before the hold board (checked after the READ)
said anything. So each holder rank seals every hold::

    holder rank q                         reader daemon (before any READ is posted)
    ─────────────                         ─────────────────────────────────────────
    hold_key_q: 32 random bytes per       learns hold_key_q at the handshake (only an
      registration, never leaves the        authenticated, introduced reader does)
      daemons
    Hold(request, blocks)                 ReadSpec(remote request, remote blocks,
      -> cap_q = MAC(hold_key_q,            capabilities [cap_0, cap_1, ...])
               request, blocks)           -> MAC(hold_key_q, request, blocks) == cap_q
      -> to its engine (HoldReply),          for every rank q it reads from; else
         on to decode (kv_transfer_params)    PERMISSION_DENIED, nothing copied

A capability is 16 bytes: the key's id (4 bytes, a hash of the key) and a
MAC (12 bytes, keyed BLAKE2b over the request id and every group's block ids,
in order), so it covers one exact block list: a read of other blocks, of the
same blocks under another request, or with a capability of another rank
fails. The key id tells a reader that a capability comes from another
registration of the holder than the one it knows (a restart, or made up):
the reader refuses the read and asks the holder for its incarnation, never
re-handshaking on the key id's word. Notices
carry the capability too, so a notice ends only a hold its sender could read
(the holder compares it with what it minted).

Pure arithmetic; where the key comes from is the caller's business.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections.abc import Sequence

import numpy as np

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError

HOLD_KEY_BYTES = 32
KEY_ID_BYTES, MAC_BYTES = 4, 12
CAPABILITY_BYTES = KEY_ID_BYTES + MAC_BYTES
_PERSON = b"kvxferd-hold-v1"  # BLAKE2b personalisation: these MACs mean nothing elsewhere
_KEY_ID_PERSON = b"kvxferd-keyid-v1"


@functools.lru_cache(maxsize=1024)  # one per registration a daemon knows: keyed once, copied per use
def key_id(hold_key: bytes) -> bytes:
    """The first :data:`KEY_ID_BYTES` of every capability a key seals (names the key, reveals nothing of it)."""
    return hashlib.blake2b(hold_key, digest_size=KEY_ID_BYTES, person=_KEY_ID_PERSON).digest()


@functools.lru_cache(maxsize=1024)
def _keyed(hold_key: bytes):
    return hashlib.blake2b(key=hold_key, digest_size=MAC_BYTES, person=_PERSON)


def hold_capability(hold_key: bytes, request_id: str, block_ids: Sequence) -> bytes:
    """The capability of holding ``block_ids`` (one id sequence per group) for ``request_id``."""
    mac = _keyed(hold_key).copy()
    encoded = request_id.encode()
    mac.update(struct.pack("<II", len(encoded), len(block_ids)))
    mac.update(encoded)
    for ids in block_ids:
        ids = np.asarray(ids, dtype="<i8")  # never wraps: 2**32 + 5 is not 5
        mac.update(struct.pack("<I", len(ids)))
        mac.update(ids.tobytes())
    return key_id(hold_key) + mac.digest()


def check_capability_bytes(capability: bytes, field: str) -> bytes:
    """A capability as it arrives (external input): exactly :data:`CAPABILITY_BYTES` bytes."""
    if not isinstance(capability, (bytes, bytearray)) or len(capability) != CAPABILITY_BYTES:
        size = len(capability) if isinstance(capability, (bytes, bytearray)) else type(capability).__name__
        raise InvalidArgumentError(field, f"a capability is {CAPABILITY_BYTES} bytes, got {size}")
    return bytes(capability)


def check_capability(hold_key: bytes, request_id: str, block_ids: Sequence, capability: bytes, field: str) -> None:
    """Raise :class:`PermissionDeniedError` naming ``field`` unless ``capability`` seals this exact hold."""
    if not hmac.compare_digest(hold_capability(hold_key, request_id, block_ids), capability):
        raise PermissionDeniedError(field, f"does not match a hold of request {request_id!r} on these blocks "
                                           "(a read may name only the blocks its holder held)")


def check_read_capabilities(hold_keys: Sequence[bytes], request_id: str, block_ids: Sequence,
                            capabilities: Sequence[bytes], field: str = "remote_capabilities") -> None:
    """Every remote rank's capability of one read (``hold_keys[q]`` seals rank q's holds), before it is posted."""
    if len(capabilities) != len(hold_keys):
        raise PermissionDeniedError(field, f"{len(capabilities)} capabilities for {len(hold_keys)} remote ranks "
                                           "(each rank's HoldReply.capability, in rank order)")
    for q, (hold_key, capability) in enumerate(zip(hold_keys, capabilities)):
        check_capability(hold_key, request_id, block_ids, check_capability_bytes(capability, f"{field}[{q}]"),
                         f"{field}[{q}]")


def sealed_by_other_keys(hold_keys: Sequence[bytes], capabilities: Sequence[bytes]) -> bool:
    """Whether some capability names another key than the one known for its rank: the holder registered
    again since (a new key) and the reader should learn it anew before judging the read."""
    return len(capabilities) == len(hold_keys) and any(
        len(c) == CAPABILITY_BYTES and c[:KEY_ID_BYTES] != key_id(k) for k, c in zip(hold_keys, capabilities))


# ---- push keys (issue #57) ---------------------------------------------------------------------
# A push is named by its transfer id, which the prefill engine's bus events and both daemons' logs carry:
# a name, not a secret. What lets a decode rank receive a prefill hold's blocks is the transfer's push key:
#
#   proxy: key K (16 random bytes)  ──► decode leg: K  ──► decode daemon's expectation carries K
#                                   ──► prefill leg: digest(K) ──► the prefill hold keeps digest(K)
#   prefill daemon: writes only when digest(expectation's K) == the hold's digest (and never into a hold
#   placed without one: a pull's hold cannot be pushed to anyone)

PUSH_KEY_BYTES = 16
PUSH_DIGEST_BYTES = 32
_PUSH_PERSON = b"kvxferd-push-v1"


def push_key_digest(push_key: bytes) -> bytes:
    """What a push's prefill hold keeps of its key (:data:`PUSH_DIGEST_BYTES`; reveals nothing of the key)."""
    return hashlib.blake2b(bytes(check_push_key(push_key, "push_key")), digest_size=PUSH_DIGEST_BYTES,
                           person=_PUSH_PERSON).digest()


def check_push_key(push_key: bytes, field: str) -> bytes:
    """A push key as it arrives (external input): exactly :data:`PUSH_KEY_BYTES` bytes."""
    if not isinstance(push_key, (bytes, bytearray)) or len(push_key) != PUSH_KEY_BYTES:
        size = len(push_key) if isinstance(push_key, (bytes, bytearray)) else type(push_key).__name__
        raise InvalidArgumentError(field, f"a push key is {PUSH_KEY_BYTES} bytes, got {size}")
    return bytes(push_key)


def check_push_digest(digest: bytes, field: str) -> bytes:
    """A hold's push key digest as it arrives: empty (no push) or exactly :data:`PUSH_DIGEST_BYTES` bytes."""
    if not isinstance(digest, (bytes, bytearray)) or len(digest) not in (0, PUSH_DIGEST_BYTES):
        size = len(digest) if isinstance(digest, (bytes, bytearray)) else type(digest).__name__
        raise InvalidArgumentError(field, f"a push key digest is {PUSH_DIGEST_BYTES} bytes (or none), got {size}")
    return bytes(digest)


def push_key_opens(push_key: bytes, digest: bytes) -> bool:
    """Whether ``push_key`` is the key of a hold that keeps ``digest`` (never for a hold without one)."""
    return len(digest) == PUSH_DIGEST_BYTES and hmac.compare_digest(push_key_digest(push_key), digest)
