"""Issue 35: allow-list wildcards stay inside one path segment (fnmatch's ``*`` crossed ``/``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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
    assert identity_matches(identity, pattern) == brute(identity, pattern)


def test_a_namespace_wildcard_names_one_segment():
    pattern = "spiffe://cluster.local/ns/*/sa/kvxferd"
    assert identity_matches("spiffe://cluster.local/ns/serving/sa/kvxferd", pattern)
    assert not identity_matches("spiffe://cluster.local/ns/a/sa/x/sa/kvxferd", pattern)  # fnmatch let this in
    assert not identity_matches("spiffe://cluster.local/ns/serving/sa/kvxferd-2", pattern)
    assert not identity_matches("DNS:kvxferd-peer", "[Dd]NS:kvxferd-peer")  # no classes: "[" is literal
    assert identity_matches("[Dd]NS:x", "[Dd]NS:?")
