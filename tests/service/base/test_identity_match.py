"""Issue 35: allow-list wildcards stay inside one path segment (fnmatch's ``*`` crossed ``/``).
Issue 53: identities and patterns are typed (uri:, dns:, ...); test_identity_types.py has the daemons."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base.config import DaemonConfig
from kvxferd.service.base.identities import glob_matches, parse_pattern
from kvxferd.service.peers.tls import identity_matches

ALPHABET = "ab/*?.[]"


def brute(identity: str, pattern: str) -> bool:
    """Reference: try every way to match, character by character."""
    if not pattern:
        return not identity
    head, rest = pattern[0], pattern[1:]
    if head == "*":  # any run of non-"/" characters, shortest first
        for n in range(len(identity) + 1):
            if "/" in identity[:n]:
                break
            if brute(identity[n:], rest):
                return True
        return False
    if not identity:
        return False
    if head == "?":
        return identity[0] != "/" and brute(identity[1:], rest)
    return identity[0] == head and brute(identity[1:], rest)


@given(st.text(ALPHABET, max_size=8), st.text(ALPHABET, max_size=6))
def test_matches_the_brute_force_reference(identity, pattern):
    assert glob_matches(identity, pattern) == brute(identity, pattern)
    if pattern and not pattern.startswith("//"):  # (an empty value and uri:// are refused: below)
        assert identity_matches("uri:" + identity, "uri:" + pattern) == brute(identity, pattern)


def test_a_namespace_wildcard_names_one_segment():
    pattern = "spiffe://cluster.local/ns/*/sa/kvxferd"
    assert identity_matches("uri:spiffe://cluster.local/ns/serving/sa/kvxferd", pattern)
    assert not identity_matches("uri:spiffe://cluster.local/ns/a/sa/x/sa/kvxferd", pattern)  # fnmatch let this in
    assert not identity_matches("uri:spiffe://cluster.local/ns/serving/sa/kvxferd-2", pattern)
    assert not identity_matches("dns:kvxferd-peer", "dns:[kK]vxferd-peer")  # no classes: "[" is literal
    assert identity_matches("dns:[k]x", "dns:[k]?")


def test_a_pattern_admits_its_own_type_only():
    spiffe = "spiffe://cluster.local/ns/serving/sa/kvxferd"
    for pattern in (spiffe, "uri:" + spiffe, "URI:" + spiffe):
        assert identity_matches("uri:" + spiffe, pattern)
        assert not identity_matches("dns:" + spiffe, pattern)  # a DNS SAN spelling the URI
        assert not identity_matches("cn:" + spiffe, pattern)
    assert identity_matches("dns:kvxferd-peer", "DNS:KVXFERD-peer")  # DNS names ignore case
    assert not identity_matches("uri:kvxferd-peer", "dns:kvxferd-peer")
    assert identity_matches("cn:kvxferd", "CN=kvxferd") and not identity_matches("dns:kvxferd", "CN=kvxferd")
    assert identity_matches("ip:::1", "ip:0:0::1") and not identity_matches("dns:::1", "ip:::1")
    assert identity_matches("dns:a.b", "dns:*") and not identity_matches("uri:x:a.b", "dns:*")  # "*": a value only


@pytest.mark.parametrize("pattern", ["kvxferd-peer", "*", "*://x", "10.0.0.1", "dns://x", "ip:not-an-ip", "uri:",
                                     "urn:x", "cn=x"])
def test_an_untyped_or_ambiguous_pattern_is_refused_at_start(pattern):
    with pytest.raises(InvalidArgumentError, match="write uri:"):
        parse_pattern(pattern)
    with pytest.raises(ValidationError, match="peer_allowed_ids"):
        DaemonConfig(peer_allowed_ids=["spiffe://td/a", pattern])
