"""Notices: fixed binary records, every field checked on decode."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.notifications import ReadNotice


def test_notice_round_trip_and_rejects_garbage():
    notice = ReadNotice("req|1:ü", "decode", 3, 4, ok=False, capability=bytes(range(16)))
    assert ReadNotice.decode(notice.encode()) == notice
    alone = ReadNotice("r", "d", 0, 1, alone=True)
    assert ReadNotice.decode(alone.encode()) == alone and alone.encode()[3] == 3
    good = ReadNotice("r", "d", 0, 1).encode()
    for message, field in [(b"\xff", "notification"), (b"[1]" * 5, "notification"),
                           (good[:2] + b"\x01" + good[3:], "notification.version"),  # before capabilities
                           (good[:3] + b"\x04" + good[4:], "notification.flags"),
                           (good[:6] + b"\x00\x00" + good[8:], "notification.expected_readers"),
                           (good + b"x", "notification"), (good[:-1], "notification"),
                           (good[:8] + b"\x00\x00" + good[10:], "notification"),
                           (good[:28] + b"\xff" + good[29:], "notification"),  # the request id's UTF-8
                           (b"KA" + good[2:], "notification")]:  # a version 3 ack
        with pytest.raises(InvalidArgumentError) as err:
            ReadNotice.decode(message)
        assert err.value.field == field, message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_record_or_a_typed_error(message):
    try:
        record = ReadNotice.decode(message)
    except InvalidArgumentError:
        return
    assert ReadNotice.decode(record.encode()) == record and record.encode() == bytes(message)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40), st.integers(0, 65535),
       st.integers(1, 65535), st.booleans(), st.booleans())
def test_notices_round_trip(request_id, engine_id, rank, expected, ok, alone):
    notice = ReadNotice(request_id, engine_id, rank, expected, ok, alone)
    assert ReadNotice.decode(notice.encode()) == notice
