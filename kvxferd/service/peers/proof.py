"""Which daemon answers a TLS peer call: its challenge signed by a certificate on the allow-list (issue #53).

gRPC's Python client checks a server's chain and ``peer_server_name``
but shows nothing of the certificate, so a peer of another namespace whose
certificate the same CA signed (a shared ClusterIssuer) could pose as a
holder and receive the reader's notice-agent metadata. Before anything else
goes to a peer, the dialling daemon challenges it (:mod:`kvxferd.wire.challenge`)::

    reader                                             holder (mutual TLS, so the reader is allowed)
    Challenge(c)                      ──────►          sign("kvxferd-peer-signed-v1" c s) with its TLS key
                                      ◄──────          s, signature, its certificate (PEM, chain after it)
    chain to tls_ca, names peer_server_name, an identity on peer_allowed_ids, signature by its key?
    else PERMISSION_DENIED: nothing more is sent

Only an allowed peer may call Challenge, so a foreign server cannot relay
the reader's nonce to a real daemon and pass its signature on.
"""

from __future__ import annotations

import datetime
import threading

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.x509.verification import Criticality, ExtensionPolicy, PolicyBuilder, Store, VerificationError

from kvxferd.errors import PermissionDeniedError
from kvxferd.service.peers.tls import TlsFiles, TlsMaterial, certificate_identities, identity_matches
from kvxferd.wire.challenge import Nonces, signed_message

MAX_CERTIFICATE_BYTES = 64 << 10  # a leaf and its intermediates in PEM
# The Web PKI's rules (intermediates must be CAs, the leaf must be for server auth and name
# peer_server_name), less one that private CAs and gRPC's own check do not need: an Authority Key
# Identifier on every certificate (cert-manager's and kvxferd dev-certs' leaves have none).
_EE_POLICY = ExtensionPolicy.webpki_defaults_ee().may_be_present(x509.AuthorityKeyIdentifier, Criticality.AGNOSTIC,
                                                                 None)
_CA_POLICY = ExtensionPolicy.webpki_defaults_ca().may_be_present(x509.AuthorityKeyIdentifier, Criticality.AGNOSTIC,
                                                                 None)


class ChallengeSigner:
    """Signs challenges with this daemon's TLS key, following rotation (the key is parsed once per generation)."""

    def __init__(self, tls: TlsFiles) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._generation, self._key = -1, None

    def sign(self, nonces: Nonces) -> tuple[bytes, bytes]:
        """``(signature, certificate PEM)`` answering ``nonces``, with the files in use now."""
        material: TlsMaterial = self.tls.current()
        with self._lock:
            if material.generation != self._generation:
                self._key = serialization.load_pem_private_key(material.key, password=None)
                self._generation = material.generation
            key = self._key
        return _sign(key, signed_message(nonces)), material.cert


def _sign(key, message: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(message, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(message, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.DIGEST_LENGTH), hashes.SHA256())
    return key.sign(message)  # Ed25519, Ed448


def _verify(public, signature: bytes, message: bytes) -> None:
    if isinstance(public, ec.EllipticCurvePublicKey):
        public.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    elif isinstance(public, rsa.RSAPublicKey):
        public.verify(signature, message, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.DIGEST_LENGTH),
                      hashes.SHA256())
    elif isinstance(public, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
        public.verify(signature, message)
    else:
        raise InvalidSignature(f"a {type(public).__name__} cannot sign a challenge")


def check_signed_proof(tls: TlsFiles, address: str, nonces: Nonces, signature: bytes, certificate_pem: bytes,
                       now: datetime.datetime | None = None) -> str:
    """The allowed identity of the peer at ``address`` that answered ``nonces`` with ``signature`` and
    ``certificate_pem``; raises :class:`PermissionDeniedError` naming what failed."""
    def refuse(why: str) -> PermissionDeniedError:
        return PermissionDeniedError("peer_addresses", f"{address}: {why}; nothing secret was sent to it")

    if not certificate_pem or len(certificate_pem) > MAX_CERTIFICATE_BYTES:
        raise refuse("its challenge answer carries no certificate (or one over 64 KiB)")
    try:
        leaf, *intermediates = x509.load_pem_x509_certificates(bytes(certificate_pem))
    except ValueError:
        raise refuse("its challenge answer's certificate is not PEM") from None
    material = tls.current()
    verifier = (PolicyBuilder().store(Store(x509.load_pem_x509_certificates(material.ca)))
                .extension_policies(ca_policy=_CA_POLICY, ee_policy=_EE_POLICY)
                .time(now or datetime.datetime.now(datetime.timezone.utc))
                .build_server_verifier(x509.DNSName(tls.server_name or "kvxferd-peer")))
    try:
        verifier.verify(leaf, intermediates)
    except VerificationError as err:
        raise refuse(f"its certificate does not chain to tls_ca for peer_server_name ({str(err)[:200]})") from None
    identities = certificate_identities(leaf)
    identity = next((i for i in identities if any(identity_matches(i, p) for p in tls.allowed_ids)), None)
    if identity is None:
        raise refuse(f"its identity {', '.join(identities)[:200]} is not on peer_allowed_ids")
    try:
        _verify(leaf.public_key(), bytes(signature), signed_message(nonces))
    except InvalidSignature:
        raise refuse("its challenge is not signed by its certificate's key") from None
    return identity
