"""Hold table: every hold ends exactly once; a notice is acknowledged alive only while held."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError, NotFoundError
from kvxferd.plan.leases import CONSUMED, EXPIRED, HoldTable
from kvxferd.plan.notifications import ReadAck, ReadNotice, is_ack


def notice(rid="r", reader=0, expected=2, ok=True):
    return ReadNotice(rid, "dec", reader, expected, ok)


def test_consumed_after_every_reader_and_only_then():
    table = HoldTable()
    table.hold("r", ((1, 2),), 10, now=0)
    first = table.record(notice(reader=0), now=1)
    assert first.alive and first.end is None
    assert table.record(notice(reader=0), now=1).end is None  # a repeated reader does not count twice
    last = table.record(notice(reader=1), now=2)
    assert last.alive and last.end.kind == CONSUMED and last.end.block_ids == ((1, 2),)
    assert len(table) == 0 and not table.record(notice(reader=1), now=2).alive


def test_expiry_is_exact_even_before_the_timer_runs():
    table = HoldTable()
    table.hold("r", (), 1.0, now=0)
    assert not table.record(notice(), now=1.0).alive  # lease over at 1.0, the expiry tick has not run
    (end,) = table.expire(now=1.0)
    assert end.kind == EXPIRED and end.reason == "lease" and table.expire(now=5) == []


def test_renew_release_and_failed_readers():
    table = HoldTable()
    table.hold("r", (), 1.0, now=0)
    assert table.renew(["r", "x"], 5.0, now=0.5) == ["x"]
    assert table.record(notice(ok=False), now=4).failed
    end = table.record(notice(reader=1), now=4).end
    assert end.kind == CONSUMED and end.failed_readers == (("dec", 0),)
    table.hold("q", (), 1.0, now=0)
    assert table.release("q").reason == "released"
    with pytest.raises(NotFoundError):
        table.release("q")
    table.hold("z", (), 1.0, now=0)
    with pytest.raises(InvalidArgumentError):
        table.hold("z", (), 1.0, now=0)
    with pytest.raises(InvalidArgumentError):
        table.record(notice("z", expected=2), now=0.1) and table.record(notice("z", reader=1, expected=3), now=0.1)
    assert [e.request_id for e in table.drop_all("engine gone")] == ["z"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "notice", "renew", "release", "tick"]),
                          st.integers(0, 3), st.integers(0, 2)), max_size=40))
def test_every_hold_ends_exactly_once(ops):
    """Random interleavings: holds end once; alive acks only between hold and end."""
    table, now, live, ended, started = HoldTable(), 0.0, set(), [], 0
    for op, rid_n, reader in ops:
        rid = f"r{rid_n}"
        now += 0.4
        if op == "hold" and rid not in live:
            table.hold(rid, (), 1.0, now)
            live.add(rid)
            started += 1
        elif op == "notice":
            out = table.record(notice(rid, reader, expected=3), now)
            assert out.alive == (rid in live and not _expired(table, rid, now))
            if out.end:
                ended.append(out.end)
                live.discard(rid)
        elif op == "renew":
            table.renew([rid], 1.0, now)
        elif op == "release" and rid in live:
            ended.append(table.release(rid))
            live.discard(rid)
        for end in table.expire(now):
            ended.append(end)
            live.discard(end.request_id)
    ended += table.drop_all("end")
    assert len(ended) == started


def _expired(table, rid, now):
    entry = table._holds.get(rid)
    return entry is not None and entry.expires_s <= now


def test_ack_round_trip_and_validation():
    ack = ReadAck("r", "dec", 1, False)
    message = ack.encode()
    assert is_ack(message) and not is_ack(notice().encode())
    assert ReadAck.decode(message) == ack
    for bad in (b"nope", b'{"ack": 2}', b'{"ack": 1, "request_id": "r", "reader_engine_id": "d", "reader_rank": true, "alive": 1}'):
        with pytest.raises(InvalidArgumentError):
            ReadAck.decode(bad)


def test_the_holders_own_reader_count_wins_over_a_notice():
    """A notice announcing one reader cannot end a hold the holder knows two readers need (issue 11, attack 4)."""
    table = HoldTable()
    table.hold("r", (), 10, now=0)
    with pytest.raises(InvalidArgumentError, match="expected_readers"):
        table.record(notice(expected=1), now=1, expected_readers=2)
    assert len(table) == 1  # still held
    assert table.record(notice(reader=0), now=1, expected_readers=2).end is None
    assert table.record(notice(reader=1), now=1, expected_readers=2).end.kind == CONSUMED
