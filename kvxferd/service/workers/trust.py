"""When the NIXL metadata peers were handed must stop reaching anything (issue #55 item 3, docs/dataplane.md).

NIXL cannot revoke one peer: whoever holds an agent's metadata reaches that
agent (over UCX's TCP lane: the whole process serving it) until the agent is
gone. So with ``dataplane_workers`` an engine rank's worker is replaced (make
before break: :meth:`WorkerSupervisor.replace`) when trust in anyone who was
handed its metadata ends::

    tls_ca withdrew a CA (the last step of a rotation) ──► every served rank   CA_CHANGED
                                                           (its reader worker too: holders know its address)
    a certificate it was handed to nears its expiry    ──► that rank           CERTIFICATE_EXPIRES
    an identity's last introduction here was evicted   ──► that rank           INTRODUCTION_ENDED

A certificate that expires within the lead (the replacement, a start and the
grace) is handed no metadata at all: otherwise each replacement would hand
the next generation to it again, and be due again at once.

A certificate rotated by cert-manager stays valid (TLS accepts it) until it
expires: metadata handed to it lives that long and no longer. A reader that
introduces another agent of its own (it restarted), or whose own idle entry
made room for its next, ends no trust: the same identity holds a live
introduction here, and may ask for the metadata again.
The peer allow-list is fixed for a daemon's life (a new one starts new workers).
"""

from __future__ import annotations

import functools
import math
import threading

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvxferd.service.base.metrics import WORKER_REPLACE_REASONS

CA_CHANGED, CERTIFICATE_EXPIRES, INTRODUCTION_ENDED = WORKER_REPLACE_REASONS  # the metric's reason labels


@functools.lru_cache(maxsize=256)
def certificate_expiry_s(pem: bytes) -> float:
    """A PEM certificate's notAfter, in seconds since the epoch (``inf`` for one that does not parse: gRPC
    verified the chain before any call, so that does not happen in practice)."""
    try:
        return x509.load_pem_x509_certificate(pem).not_valid_after_utc.timestamp()
    except ValueError:
        return math.inf


def peer_certificate_expiry_s(context) -> float:
    """When the TLS certificate of a gRPC call's peer expires (``inf`` without TLS: a host's peer secret
    does not expire; its daemons are one identity)."""
    certificates = context.auth_context().get("x509_pem_cert", ())
    return certificate_expiry_s(certificates[0]) if certificates else math.inf


class HandedMetadata:
    """Until when the metadata of a rank's serving worker generation may be trusted: the earliest expiry of
    the certificates it was handed to (thread-safe; handed on the event loop, checked on its tick)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._trusted_until_s = math.inf

    def handed(self, generation: int, expiry_s: float) -> None:
        """Generation ``generation``'s metadata went to a certificate valid until ``expiry_s``. A newer
        generation starts afresh: what older ones were handed goes with them."""
        with self._lock:
            if generation > self._generation:
                self._generation, self._trusted_until_s = generation, math.inf
            if generation == self._generation:
                self._trusted_until_s = min(self._trusted_until_s, expiry_s)

    def due(self, generation: int, now_s: float, lead_s: float) -> bool:
        """Whether generation ``generation`` must be replaced now: within ``lead_s`` of the first expiry (the
        replacement, its start and the old one's grace must fit before it)."""
        with self._lock:
            return generation == self._generation and now_s >= self._trusted_until_s - lead_s

    @property
    def trusted_until_s(self) -> float:
        with self._lock:
            return self._trusted_until_s


def bundle_certificates(bundle: bytes) -> frozenset[bytes]:
    """The certificates of a PEM bundle, as DER (order, comments and spacing do not count); the raw bytes
    as the one member of a bundle that does not parse (TlsFiles refuses such files anyway)."""
    try:
        return frozenset(c.public_bytes(serialization.Encoding.DER) for c in x509.load_pem_x509_certificates(bundle))
    except ValueError:
        return frozenset((bundle,))


class CaWatch:
    """Says when a CA bundle withdraws a CA the last one had: only that ends trust (a CA added to the
    bundle, a rotation's first step, trusts more peers; none of them was handed anything yet)."""

    def __init__(self, ca: bytes) -> None:
        self._cas = bundle_certificates(ca)

    def withdrawn(self, ca: bytes) -> bool:
        cas = bundle_certificates(ca)
        gone, self._cas = bool(self._cas - cas), cas
        return gone
