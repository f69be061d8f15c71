"""Notices and the prefill ledger: release exactly once, after every reader."""

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.holds import ReadLedger
from kvxferd.plan.notifications import ReadNotice


def test_notice_round_trip_and_rejects_garbage():
    notice = ReadNotice("req|1:ü", "decode", 3, 4, ok=False)
    assert ReadNotice.decode(notice.encode()) == notice
    for message, field in [(b"\xff", "notification"), (b"[1]", "notification.v"), (b'{"v":2}', "notification.v"),
                           (b'{"v":1,"request_id":"r","reader_engine_id":"d","reader_rank":true,"expected_readers":1,"ok":true}',
                            "notification.reader_rank"),
                           (b'{"v":1,"request_id":"r","reader_engine_id":"d","reader_rank":0,"expected_readers":0,"ok":true}',
                            "notification")]:
        with pytest.raises(InvalidArgumentError) as err:
            ReadNotice.decode(message)
        assert err.value.field == field


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
