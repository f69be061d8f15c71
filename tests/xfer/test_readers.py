"""Issue 53, M2: the reader table keeps identities apart, caps them, and lets only idle readers give up places.
(Against real daemons: tests/security/test_reader_expiry.py.)"""

from __future__ import annotations

import pytest

from kvxferd.errors import ResourceExhaustedError
from kvxferd.xfer.readers import Introduced, Reader, ReaderLimits, ReaderTable

LIMITS = ReaderLimits(max_readers=4, max_per_identity=2, idle_s=10.0)


def reader(agent: str, identity: str = "A", expected: int = 1) -> Reader:
    return Reader(agent, 1, expected, identity)


def test_identities_never_collide_and_a_notice_finds_its_own_agent():
    table = ReaderTable()
    assert table.introduce(("r", 0), reader("b-agent", "B"), LIMITS, now=0).outcome is Introduced.NEW  # B first
    assert table.introduce(("r", 0), reader("a-agent", "A"), LIMITS, now=0).outcome is Introduced.NEW  # the owner too
    assert table.sender_reader(("r", 0), "a-agent").identity == "A"
    assert table.sender_reader(("r", 0), "b-agent").identity == "B"
    assert table.sender_reader(("r", 0), "mallory") is None and table.sender_reader(("r", 1), "a-agent") is None
    # A copy of A's agent name under B: the notice goes to the entry that expects its count of readers.
    table.introduce(("r", 0), Reader("a-agent", 4, 3, "B"), LIMITS, now=0)
    assert table.sender_reader(("r", 0), "a-agent", expected_readers=1).identity == "A"


def test_a_replacement_is_the_same_identitys_and_says_so():
    table = ReaderTable()
    table.introduce(("r", 0), reader("old"), LIMITS, now=0)
    assert table.introduce(("r", 0), reader("old"), LIMITS, now=1).outcome is Introduced.AGAIN
    introduction = table.introduce(("r", 0), reader("new"), LIMITS, now=2)
    assert (introduction.outcome, introduction.replaced_agent) == (Introduced.REPLACED, "old")
    assert table.sender_reader(("r", 0), "old") is None and len(table) == 1


def test_an_identity_past_its_cap_is_refused_until_one_of_its_readers_is_idle():
    table = ReaderTable()
    table.introduce(("r", 0), reader("a0"), LIMITS, now=0)
    table.introduce(("r", 1), reader("a1"), LIMITS, now=5)
    with pytest.raises(ResourceExhaustedError, match="max_readers_per_identity"):
        table.introduce(("r", 2), reader("a2"), LIMITS, now=9)
    assert table.introduce(("x", 0), reader("b0", "B"), LIMITS, now=9).outcome is Introduced.NEW  # B has room
    found = table.sender_reader(("r", 0), "a0")
    table.touch(("r", 0), found, now=9)  # a sealed notice: r/0 is active again, r/1 is now the idle one
    introduction = table.introduce(("r", 2), reader("a2"), LIMITS, now=15.5)
    assert introduction.evicted == (("A", "r", 1),) and table.count("A") == 2
    assert table.sender_reader(("r", 1), "a1") is None and table.sender_reader(("r", 0), "a0") is not None


def test_a_full_rank_gives_up_only_an_idle_reader_of_any_identity():
    table = ReaderTable()
    for n, identity in enumerate("AABB"):
        table.introduce((f"r{n}", 0), reader(f"agent{n}", identity), LIMITS, now=n)
    with pytest.raises(ResourceExhaustedError, match="max_readers_per_engine"):
        table.introduce(("c", 0), reader("c", "C"), LIMITS, now=9.5)  # all four active in the last 10 s
    assert len(table) == 4


def test_a_full_rank_gives_up_its_least_recently_active_idle_reader():
    table = ReaderTable()
    for n, identity in enumerate("AABB"):
        table.introduce((f"r{n}", 0), reader(f"agent{n}", identity), LIMITS, now=n)
    introduction = table.introduce(("c", 0), reader("c", "C"), LIMITS, now=11.5)  # r0 and r1 idle; r0 the longest
    assert introduction.evicted == (("A", "r0", 0),) and len(table) == 4 and ("c", 0) in table
    copy = table.copy()
    assert len(copy) == 4 and copy.get(("c", 0), "C") == reader("c", "C")


def test_a_readers_daemon_can_ask_whether_it_still_has_its_place_and_keep_it():
    table = ReaderTable()
    table.introduce(("r", 0), reader("a0"), LIMITS, now=0)
    table.introduce(("r", 1), reader("a1"), LIMITS, now=1)
    assert table.refresh(("r", 0), "A", now=20) and not table.refresh(("r", 0), "B", now=20)
    assert table.introduce(("r", 2), reader("a2"), LIMITS, now=20).evicted == (("A", "r", 1),)  # r/0 kept its place
    assert not table.refresh(("r", 1), "A", now=21)  # gone: its daemon introduces it again
