"""Proving that a reader runs on the holder's host: its boot id and the host's peer secret.

A same-host reader maps the holder engine's shared memory itself (issue
#37), so the holder must know, not assume, that the reader shares its
kernel. The reader's ``GetEngineInfo`` carries a token (an HMAC of the
host's peer secret) over the holder's boot id, its address and the nonces of
the challenge the holder just passed (:mod:`kvxferd.wire.challenge`)::

    reader                                          holder
    token = HMAC(secret, "same-host" boot_id "/" address, c s)
                                      ──────────►  the same over ITS boot id and address and the
                                                   nonces it issued and took for this call:
                                                   equal -> the names of its shm objects

Only a process that reads this host's secret file makes the token, and
only for the boot id this kernel has: a copied secret on another host
names another boot id, and a token is good for one call only. The reader reads its own boot id, so a token proves the reader's
kernel is the holder's (containers share the host's boot id).

The other way round, the reader maps nothing a holder names unless the
holder proves the same (:func:`holder_proof`, over the reader's token): an
engine names the addresses its daemon dials, so a listener of another user
could otherwise answer with the name of an object the daemon may open and
the engine may not, and have it copied into the engine's cache.
"""

from __future__ import annotations

import dataclasses
import functools

from kvxferd.plan.groups import EngineCache
from kvxferd.wire.challenge import Nonces, bound_mac
from kvxferd.wire.peerauth import tokens_match
from kvxferd.wire.peerinfo import PeerInfo

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@functools.cache
def boot_id() -> str:
    """This kernel's boot id ("" where the kernel has none: no same-host proof is possible then)."""
    try:
        with open(BOOT_ID_PATH) as file:
            return file.read().strip()
    except OSError:
        return ""


_READER, _HOLDER = b"kvxferd-same-host-v2\0", b"kvxferd-same-host-holder-v2\0"


def _token(secret: bytes, context: bytes, subject: str, nonces: Nonces) -> str:
    return bound_mac(secret, context, subject, nonces).hex()


def same_host_token(secret: bytes, address: str, nonces: Nonces) -> str:
    """The token a reader presents to the holder it dials at ``address``, in the call that follows the
    challenge ``nonces``; "" without a boot id."""
    boot = boot_id()
    return _token(secret, _READER, f"{boot}/{address}", nonces) if boot else ""


def is_same_host(secret: bytes, address: str, nonces: Nonces | None, presented: str) -> bool:
    """Whether ``presented`` proves a caller on this host (this boot) that holds ``secret``, in the call that
    used up ``nonces`` here (None: the call followed no challenge); ``address``: this daemon's own peer
    address, as its readers dial it."""
    boot = boot_id()
    if not (boot and presented and nonces is not None):
        return False
    return tokens_match(_token(secret, _READER, f"{boot}/{address}", nonces), presented)


def holder_proof(secret: bytes, address: str, request_token: str) -> str:
    """What a holder at ``address`` answers a proven reader's ``request_token`` with; "" without a boot id."""
    boot = boot_id()
    if not (boot and request_token):
        return ""
    return _token(secret, _HOLDER, f"{boot}/{address}/{request_token}", Nonces(b"", b""))


def holder_proved(secret: bytes, address: str, request_token: str, proof: str) -> bool:
    """Whether the holder dialed at ``address`` proved this host (``proof`` over the reader's token)."""
    expected = holder_proof(secret, address, request_token)
    return bool(expected) and tokens_match(expected, proof)


def shares_from(info: PeerInfo, secret: bytes | None, address: str, request_token: str) -> PeerInfo:
    """``info`` as a reader may use it: what its cache's regions and its hold board lie in only when the
    holder it dialed at ``address`` proved this host (``info.same_host_proof``, over the reader's own
    token, with this host's ``secret``); else nothing of it. The engine chose the address: a listener of
    another user must not get the daemon to map what it names."""
    if secret is not None and holder_proved(secret, address, request_token, info.same_host_proof):
        return info
    return info_without_shares(info)


def info_without_shares(info: PeerInfo) -> PeerInfo:
    """``info`` naming no shared-memory object, for its cache or its board."""
    return dataclasses.replace(info, cache=without_shares(info.cache), board=dataclasses.replace(info.board, share=None))


def without_shares(cache: EngineCache) -> EngineCache:
    """``cache`` with no region naming a shared-memory object."""
    if all(r.share is None for regions in cache.memory for r in regions):
        return cache
    memory = tuple(tuple(dataclasses.replace(r, share=None) for r in regions) for regions in cache.memory)
    return dataclasses.replace(cache, memory=memory)
