"""Notices and the prefill ledger: release exactly once, after every reader."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.holds import ReadLedger
from kvxferd.plan.notifications import ReadAck, ReadNotice, is_ack


def test_notice_round_trip_and_rejects_garbage():
    notice = ReadNotice("req|1:ü", "decode", 3, 4, ok=False)
    assert ReadNotice.decode(notice.encode()) == notice
    good = ReadNotice("r", "d", 0, 1).encode()
    for message, field in [(b"\xff", "notification"), (b"[1]" * 5, "notification"),
                           (good[:2] + b"\x02" + good[3:], "notification.version"),
                           (good[:3] + b"\x04" + good[4:], "notification.flags"),
                           (good[:6] + b"\x00\x00" + good[8:], "notification.expected_readers"),
                           (good + b"x", "notification"), (good[:-1], "notification"),
                           (good[:8] + b"\x00\x00" + good[10:], "notification"),
                           (good[:12] + b"\xff" + good[13:], "notification"),
                           (ReadAck("r", "d", 0, True).encode(), "notification")]:
        with pytest.raises(InvalidArgumentError) as err:
            ReadNotice.decode(message)
        assert err.value.field == field, message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_record_or_a_typed_error(message):
    for kind in (ReadNotice, ReadAck):
        try:
            record = kind.decode(message)
        except InvalidArgumentError:
            continue
        assert kind.decode(record.encode()) == record


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40), st.integers(0, 65535),
       st.integers(1, 65535), st.booleans())
def test_records_round_trip(request_id, engine_id, rank, expected, flag):
    notice = ReadNotice(request_id, engine_id, rank, expected, flag)
    assert ReadNotice.decode(notice.encode()) == notice
    ack = ReadAck(request_id, engine_id, rank, flag)
    assert ReadAck.decode(ack.encode()) == ack and is_ack(ack.encode()) and not is_ack(notice.encode())


def test_release_after_every_distinct_reader():
    ledger = ReadLedger()
    assert ledger.hold("r", ([1, 2],)) is None
    assert ledger.record(ReadNotice("r", "d", 0, 3)) is None
    assert ledger.record(ReadNotice("r", "d", 0, 3)) is None  # duplicate reader: counted once
    assert ledger.record(ReadNotice("r", "d", 2, 3)) is None
    release = ledger.record(ReadNotice("r", "d", 1, 3, ok=False))
    assert release.request_id == "r" and release.block_ids == ([1, 2],) and release.num_readers == 3
    assert release.failed_readers == (("d", 1),) and not release.ok
    assert ledger.pending() == {}


def test_notices_before_the_hold_wait_for_it():
    ledger = ReadLedger()
    assert ledger.record(ReadNotice("r", "d", 0, 1)) is None  # the read raced the engine's bookkeeping
    assert ledger.pending() == {"r": 1}
    release = ledger.hold("r")
    assert release is not None and release.ok
    with pytest.raises(InvalidArgumentError):
        ledger.hold("x") or ledger.hold("x")


def test_inconsistent_reader_counts_are_refused():
    ledger = ReadLedger()
    ledger.record(ReadNotice("r", "d", 0, 2))
    with pytest.raises(InvalidArgumentError) as err:
        ledger.record(ReadNotice("r", "d", 1, 3))
    assert err.value.field == "notification.expected_readers"
