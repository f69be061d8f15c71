"""Mutual TLS between daemons: credentials that follow certificate rotation, and who a peer is.

::

    reader daemon                                   holder daemon
    ─────────────                                   ─────────────
    channel credentials (cert, key, CA)  ──TLS──►   server credentials, client cert required
    checks: holder's cert chains to the CA          checks: reader's cert chains to the CA
            and names peer_server_name                      and one of its identities is on
                                                            peer_allowed_ids (every peer RPC)

The files are read again when they change (cert-manager rotates a
Secret's files in place): the server picks them up at the next TLS
handshake, the client for its next new channel; live connections keep
the certificate they started with. A half-written rotation (a key that
does not match its certificate yet) keeps the previous files in use.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError, UnauthenticatedError

log = logging.getLogger("kvxferd.tls")


@dataclass(frozen=True)
class TlsMaterial:
    """One consistent reading of the three files."""

    cert: bytes
    key: bytes
    ca: bytes
    generation: int


class TlsFiles:
    """``tls_cert``, ``tls_key`` and ``tls_ca``, re-read when any of them changes (thread-safe)."""

    def __init__(self, cert_path: str, key_path: str, ca_path: str) -> None:
        self.paths = (cert_path, key_path, ca_path)
        self._lock = threading.Lock()
        self._stamp = None
        self._material: TlsMaterial | None = None
        self.num_reloads = 0
        self.on_reload = None  # called (no arguments) after changed files were loaded
        if self.current() is None:
            raise InvalidArgumentError("tls_cert", "could not read tls_cert, tls_key and tls_ca")

    def _stat(self):
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, self.paths))

    def current(self) -> TlsMaterial | None:
        """The newest readable material (None only if it was never readable)."""
        with self._lock:
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    cert, key, ca = (open(p, "rb").read() for p in self.paths)
                    _check_pair(cert, key, ca)
                    generation = self._material.generation + 1 if self._material else 0
                    self._material, self._stamp = TlsMaterial(cert, key, ca, generation), stamp
                    if generation:
                        self.num_reloads += 1
                        log.info("TLS files reloaded", extra={"generation": generation})
                        if self.on_reload is not None:
                            self.on_reload()
            except (OSError, InvalidArgumentError) as err:
                log.warning("TLS files unreadable; keeping the previous ones", extra={"error": str(err)})
            return self._material

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials requiring a client certificate; each new handshake sees rotated files."""
        first = self.current()
        served = {"generation": first.generation}

        def fetch():  # called by gRPC before each TLS handshake
            material = self.current()
            if material is None or material.generation == served["generation"]:
                return None  # keep the current configuration
            served["generation"] = material.generation
            return _server_config(material)

        return grpc.dynamic_ssl_server_credentials(_server_config(first), fetch, require_client_authentication=True)

    def channel_credentials(self) -> tuple[int, grpc.ChannelCredentials]:
        """``(generation, credentials)`` for a new channel to a peer."""
        material = self.current()
        return material.generation, grpc.ssl_channel_credentials(material.ca, material.key, material.cert)


def _check_pair(cert: bytes, key: bytes, ca: bytes) -> None:
    """PEM files whose key belongs to the certificate (else a rotation is still half-written)."""
    try:
        leaf = x509.load_pem_x509_certificate(cert)
        private = serialization.load_pem_private_key(key, password=None)
        x509.load_pem_x509_certificates(ca)
    except ValueError as err:
        raise InvalidArgumentError("tls_cert", f"not PEM certificate, key and CA files: {err}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(serialization.Encoding.DER, public) != \
            private.public_key().public_bytes(serialization.Encoding.DER, public):
        raise InvalidArgumentError("tls_key", "the key does not belong to tls_cert")


def _server_config(material: TlsMaterial):
    return grpc.ssl_server_certificate_configuration([(material.key, material.cert)], material.ca)


def peer_identities(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """What a TLS peer's certificate says it is: its SANs (DNS, URI, IP) and ``CN=...``; empty without TLS."""
    auth = context.auth_context()
    names = [v.decode(errors="replace") for v in auth.get("x509_subject_alternative_name", ())]
    names += [f"CN={v.decode(errors='replace')}" for v in auth.get("x509_common_name", ())]
    return tuple(names)


def authorize_peer(context: grpc.aio.ServicerContext, allowed: tuple[str, ...]) -> str:
    """The first identity of the caller on the allow-list (shell wildcards); raises otherwise."""
    identities = peer_identities(context)
    if not identities:
        raise UnauthenticatedError("peer", "no client certificate (mutual TLS is required on this port)")
    for identity in identities:
        if any(fnmatch.fnmatchcase(identity, pattern) for pattern in allowed):
            return identity
    raise PermissionDeniedError("peer", f"identity {', '.join(identities)[:200]} is not on peer_allowed_ids")
