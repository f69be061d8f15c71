"""Typed peer identities: what a certificate says a peer is, and which allow-list patterns admit it.

A certificate names its holder in several places: subject alternative names
of several types (URI, DNS name, IP address) and the subject's common name.
They used to be lumped into untyped strings, so a certificate whose *DNS*
SAN spelled the release's SPIFFE id (a name any issuer of the CA may sign,
e.g. a ClusterIssuer shared across namespaces) passed as the release
(issue #53, M1). Now every identity carries its type, and a pattern admits
identities of its own type only::

    certificate                          identities (certificate_identities, in this order)
    URI SAN spiffe://td/ns/a/sa/b   ──►  uri:spiffe://td/ns/a/sa/b
    DNS SAN Kvxferd-Peer            ──►  dns:kvxferd-peer          (lower case: DNS names ignore case)
    IP SAN 10.0.0.1                 ──►  ip:10.0.0.1
    subject CN=kvxferd              ──►  cn:kvxferd

    pattern (peer_allowed_ids)           admits
    uri:spiffe://td/ns/*/sa/b            URI SANs only
    spiffe://td/ns/*/sa/b                the same: an untyped pattern with a scheme ("x://") is a URI
    dns:*.peers.svc, ip:..., cn:...      that type only
    CN=kvxferd                           cn:kvxferd (the old spelling, which named the common name already)
    kvxferd-peer, 10.0.0.1, *, dns://x   refused at start (parse_pattern): say which type

In the value ``*`` is any run of characters and ``?`` one, neither crossing
``/``; everything else is literal and case-sensitive (DNS values are compared
in lower case).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable

import grpc
from cryptography import x509

from kvxferd.errors import InvalidArgumentError

IDENTITY_TYPES = ("uri", "dns", "ip", "cn")
_URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # literal: a wildcard never decides the type
LEGACY_CN = "CN="


def certificate_identities(cert: x509.Certificate) -> tuple[str, ...]:
    """A certificate's typed identities: URI SANs first (what allow-lists name by default), then DNS and IP
    SANs, then the subject's common names (``uri:...``, ``dns:...``, ``ip:...``, ``cn:...``)."""
    names: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        names += [f"uri:{v}" for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
        names += [f"dns:{v.lower()}" for v in san.get_values_for_type(x509.DNSName)]
        names += [f"ip:{v}" for v in san.get_values_for_type(x509.IPAddress)]
    names += [f"cn:{a.value}" for a in cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
              if isinstance(a.value, str)]
    return tuple(names)


@functools.lru_cache(maxsize=256)
def parse_pattern(pattern: str) -> str:
    """``pattern`` as a typed pattern (``type:value``); raises :class:`InvalidArgumentError` (field
    ``peer_allowed_ids``) for one whose type is unsaid or ambiguous, naming the spellings that would do."""
    def refuse(why: str) -> InvalidArgumentError:
        return InvalidArgumentError("peer_allowed_ids", f"{pattern!r}: {why}; write uri:<URI> (a SPIFFE id: "
                                                        "spiffe://...), dns:<name>, ip:<address> or cn:<common name>")

    if pattern.startswith(LEGACY_CN):  # the old spelling: it only ever matched the subject's common name
        kind, value = "cn", pattern[len(LEGACY_CN):]
    else:
        head, sep, rest = pattern.partition(":")
        if sep and head.lower() in IDENTITY_TYPES:
            if rest.startswith("//"):  # dns://host/... is a URI of scheme "dns" as much as a DNS pattern
                raise refuse(f"{head}:// may be a URI of scheme {head!r} or a {head} value")
            kind, value = head.lower(), rest
        elif _URI_SCHEME.match(pattern):
            kind, value = "uri", pattern
        else:
            raise refuse("no identity type (only a pattern with a URI scheme, x://..., is taken as a URI)")
    if not value:
        raise refuse("an empty value")
    if kind == "dns":
        value = value.lower()
    elif kind == "ip" and "*" not in value and "?" not in value:
        try:
            value = str(ipaddress.ip_address(value))  # as certificate_identities writes it
        except ValueError:
            raise refuse("not an IP address") from None
    return f"{kind}:{value}"


@functools.lru_cache(maxsize=256)
def _glob(pattern: str) -> re.Pattern:
    # Every other character is literal: no [classes], and a wildcard never crosses "/", so
    # spiffe://td/ns/*/sa/kvxferd names one namespace segment, never ns/a/b/sa/kvxferd.
    parts = ("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts), re.DOTALL)


def glob_matches(text: str, pattern: str) -> bool:
    """``*`` any run and ``?`` one character, neither crossing ``/``; everything else literal."""
    return _glob(pattern).fullmatch(text) is not None


def identity_matches(identity: str, pattern: str) -> bool:
    """Whether a typed identity (:func:`certificate_identities`) matches an allow-list pattern
    (:func:`parse_pattern`): of the same type, and the value by :func:`glob_matches`. Raises
    :class:`InvalidArgumentError` for an untyped identity or a pattern :func:`parse_pattern` refuses."""
    kind, sep, _ = identity.partition(":")
    if not sep or kind not in IDENTITY_TYPES:
        raise InvalidArgumentError("identity", f"{identity[:100]!r} is not a typed identity (uri:, dns:, ip:, cn:)")
    # The type is the pattern's literal prefix up to its first ":", which no wildcard can stand for.
    return glob_matches(identity, parse_pattern(pattern))


def allowed_identity(identities: Iterable[str], patterns: Iterable[str]) -> str | None:
    """The first of ``identities`` that matches one of ``patterns`` (None: the peer is not allowed)."""
    patterns = tuple(patterns)
    return next((i for i in identities if any(identity_matches(i, p) for p in patterns)), None)


def peer_identities(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """A TLS peer's typed identities (:func:`certificate_identities`), read from its certificate itself; empty
    without TLS. gRPC's ``x509_subject_alternative_name`` lumps SANs of every type into plain strings, so a DNS
    SAN spelling a SPIFFE id would pass for that URI: the certificate says which type each name has."""
    certificates = context.auth_context().get("x509_pem_cert", ())
    return _pem_identities(certificates[0]) if certificates else ()


@functools.lru_cache(maxsize=256)
def _pem_identities(pem: bytes) -> tuple[str, ...]:
    # Every peer call asks: parse each certificate once (gRPC verified its chain before any call).
    try:
        return certificate_identities(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return ()
