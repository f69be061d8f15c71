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

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError
from kvxferd.service.peers.tls import TlsFiles, TlsMaterial, certificate_identities, identity_matches
from kvxferd.wire.challenge import Nonces, signed_message

MAX_CERTIFICATE_BYTES = 64 << 10  # a leaf and its intermediates in PEM


def _must_be_ca(_policy, _cert, constraints: x509.BasicConstraints) -> None:
    if not constraints.ca:
        raise ValueError("an issuer that is not a CA (basicConstraints CA:FALSE)")


def _may_sign_certificates(_policy, _cert, usage: x509.KeyUsage | None) -> None:
    if usage is not None and not usage.key_cert_sign:
        raise ValueError("an issuer whose keyUsage lacks keyCertSign")


# What gRPC's own check (BoringSSL's) asks of an issuer, not the Web PKI's more: a CA (basicConstraints
# CA:TRUE, critical or not) that may sign certificates where it says what its key is for; keyUsage and the
# key identifiers optional (`openssl req -x509` makes CAs without keyUsage; cert-manager's leaves carry no
# Authority Key Identifier). The leaf: the Web PKI's rules (server auth, peer_server_name as a SAN) less the
# Authority Key Identifier. The daemon checks its own chain this way at start (check_own_chain), so a CA this
# refuses stops it there, not every dial later.
_CA_POLICY = (ExtensionPolicy.permit_all()
              .require_present(x509.BasicConstraints, Criticality.AGNOSTIC, _must_be_ca)
              .may_be_present(x509.KeyUsage, Criticality.AGNOSTIC, _may_sign_certificates))
_EE_POLICY = ExtensionPolicy.webpki_defaults_ee().may_be_present(x509.AuthorityKeyIdentifier, Criticality.AGNOSTIC,
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


def _verify_chain(tls: TlsFiles, leaf: x509.Certificate, intermediates: list[x509.Certificate],
                  now: datetime.datetime | None) -> None:
    verifier = (PolicyBuilder().store(Store(x509.load_pem_x509_certificates(tls.current().ca)))
                .extension_policies(ca_policy=_CA_POLICY, ee_policy=_EE_POLICY)
                .time(now or datetime.datetime.now(datetime.timezone.utc))
                .build_server_verifier(x509.DNSName(tls.server_name or "kvxferd-peer")))
    verifier.verify(leaf, intermediates)


def check_own_chain(tls: TlsFiles) -> None:
    """At start: this daemon's certificate passes the check its peers make of it when they dial it (else
    :class:`InvalidArgumentError` naming tls_cert: every dial of it would be refused, while it looked up)."""
    leaf, *intermediates = x509.load_pem_x509_certificates(tls.current().cert)
    try:
        _verify_chain(tls, leaf, intermediates, None)
    except VerificationError as err:
        raise InvalidArgumentError("tls_cert", f"peers would refuse it when they dial this daemon: it does not "
                                               f"chain to tls_ca for peer_server_name ({str(err)[:300]}); an "
                                               "Ed25519 or Ed448 CA is not supported") from None


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
    try:
        _verify_chain(tls, leaf, intermediates, now)
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
