"""Mutual TLS between daemons: credentials that follow certificate rotation, and who a peer is.

::

    reader daemon                                   holder daemon
    ─────────────                                   ─────────────
    channel credentials (cert, key, CA)  ──TLS──►   server credentials, client cert required
    checks: holder's cert chains to the CA          checks: reader's cert chains to the CA
            and names peer_server_name                      and one of its typed identities
                                                            (uri:, dns:...: identities.py) is
                                                            on peer_allowed_ids (every peer RPC)

The files are read again when they change (cert-manager rotates a
Secret's files in place): the server picks them up at the next TLS
handshake, the client for its next new channel; live connections keep
the certificate they started with. A half-written rotation (a key that
does not match its certificate yet) keeps the previous files in use.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError, UnauthenticatedError
# Typed identities (issue #53): kept importable from here, where callers have always found them.
from kvxferd.service.base.identities import (allowed_identity, certificate_identities, peer_identities,  # noqa: F401
                                              identity_matches)

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

    def __init__(self, cert_path: str, key_path: str, ca_path: str, *, server_name: str | None = None,
                 allowed_ids: tuple[str, ...] = ()) -> None:
        self.paths = (cert_path, key_path, ca_path)
        # What our own certificate must say: peers check it for server_name and, when we connect
        # to them, against their allow-list (the same list, in one deployment).
        self.server_name, self.allowed_ids = server_name, tuple(allowed_ids)
        self._lock = threading.Lock()
        self._stamp = None
        self._material: TlsMaterial | None = None
        self.num_reloads = 0
        self.on_reload = None  # called with the new TlsMaterial after changed files were loaded (under the lock)
        self.on_refused = None  # called (no arguments) when changed files were refused
        self.refused_error = ""  # why the files were last refused
        if self.current() is None:
            raise InvalidArgumentError("tls_cert", f"could not use tls_cert, tls_key and tls_ca: {self.refused_error}")

    def _stat(self):
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, self.paths))

    def current(self) -> TlsMaterial | None:
        """The newest usable material (None only if there never was any)."""
        with self._lock:
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    cert, key, ca = (open(p, "rb").read() for p in self.paths)
                    _check_pair(cert, key, ca)
                    try:
                        check_own_certificate(cert, self.server_name, self.allowed_ids)
                    except InvalidArgumentError as err:  # whole, but not a certificate to serve
                        self._refuse(str(err), counted=True)
                        return self._material
                    generation = self._material.generation + 1 if self._material else 0
                    self._material, self._stamp, self.refused_error = TlsMaterial(cert, key, ca, generation), stamp, ""
                    if generation:
                        self.num_reloads += 1
                        log.info("TLS files reloaded", extra={"generation": generation})
                        if self.on_reload is not None:
                            self.on_reload(self._material)
            except (OSError, InvalidArgumentError) as err:  # unreadable, or a rotation still half-written
                self._refuse(str(err), counted=False)
            return self._material

    def _refuse(self, error: str, *, counted: bool) -> None:
        """Keep the previous files; say why once per distinct reason (the files are looked at every second)."""
        if error != self.refused_error:
            log.warning("TLS files not used; keeping the previous ones", extra={"error": error})
            if counted and self.on_refused is not None and self._material is not None:
                self.on_refused()
        self.refused_error = error

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


def check_own_certificate(cert_pem: bytes, server_name: str | None, allowed_ids: tuple[str, ...],
                          now: datetime.datetime | None = None) -> None:
    """Refuse our own certificate if it is not valid now, lacks ``server_name`` as a DNS name, or has no
    identity on ``allowed_ids`` (peers would refuse it: better keep the one that works)."""
    leaf = x509.load_pem_x509_certificate(cert_pem)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now < leaf.not_valid_before_utc:
        raise InvalidArgumentError("tls_cert", f"not valid before {leaf.not_valid_before_utc.isoformat()}")
    if now > leaf.not_valid_after_utc:
        raise InvalidArgumentError("tls_cert", f"expired at {leaf.not_valid_after_utc.isoformat()}")
    identities = certificate_identities(leaf)
    if server_name and f"dns:{server_name.lower()}" not in identities:  # a DNS SAN: what gRPC checks when dialling
        raise InvalidArgumentError("tls_cert", f"does not name {server_name!r} (peer_server_name) as a DNS name")
    if allowed_ids and allowed_identity(identities, allowed_ids) is None:
        raise InvalidArgumentError("tls_cert", f"none of its identities {', '.join(identities)[:200]} is on "
                                               "peer_allowed_ids")


def _server_config(material: TlsMaterial):
    return grpc.ssl_server_certificate_configuration([(material.key, material.cert)], material.ca)


def authorize_peer(context: grpc.aio.ServicerContext, allowed: tuple[str, ...]) -> str:
    """The first identity of the caller on the allow-list (:func:`allowed_identity`); raises otherwise."""
    identities = peer_identities(context)
    if not identities:
        raise UnauthenticatedError("peer", "no client certificate (mutual TLS is required on this port)")
    identity = allowed_identity(identities, allowed)
    if identity is None:
        raise PermissionDeniedError("peer", f"identity {', '.join(identities)[:200]} is not on peer_allowed_ids")
    return identity

