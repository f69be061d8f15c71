"""The push expectation record (issue #57): round trips, and every malformed record refused naming the field."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.expectrecord import MAX_GROUPS, ExpectRecord, is_expectation
from kvxferd.plan.notifications import HELLO, ReadNotice

ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
groups = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=50), min_size=1, max_size=MAX_GROUPS)


@given(ids, ids, st.integers(0, 65535), groups, st.binary(min_size=16, max_size=16),
       st.floats(0.001, 600), st.binary(min_size=16, max_size=16), st.integers(0, 2**31 - 1))
def test_records_round_trip(transfer_id, engine_id, rank, block_ids, capability, deadline_s, push_key, num_tokens):
    record = ExpectRecord(transfer_id, engine_id, rank, tuple(np.array(g, np.int64) for g in block_ids), capability,
                          deadline_s, push_key, num_tokens or None)
    back = ExpectRecord.decode(record.encode())
    assert (back.transfer_id, back.reader_engine_id, back.reader_rank, back.capability, back.push_key,
            back.num_tokens) == (transfer_id, engine_id, rank, capability, push_key, num_tokens or None)
    assert [list(g) for g in back.block_ids] == block_ids
    assert abs(back.deadline_s - deadline_s) <= 1e-3 and is_expectation(record.encode())


@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_or_decode(data):
    try:
        ExpectRecord.decode(data)
    except InvalidArgumentError:
        pass


GOOD = ExpectRecord("t", "decode", 1, (np.array([3, 4]),), bytes(16), 5.0, bytes(range(16)), 70).encode()


@pytest.mark.parametrize("damage, field", [
    (lambda m: b"KX" + m[2:], "expectation"),
    (lambda m: m[:2] + b"\x09" + m[3:], "expectation.version"),
    (lambda m: m[:3] + b"\x00" + m[4:], "expectation.num_groups"),
    (lambda m: m[:-1], "expectation"),
    (lambda m: m + b"\x00", "expectation"),
    (lambda m: m[:14] + b"\x00\x00\x00\x00" + m[18:], "expectation.deadline_ms"),
    (lambda m: m[:-4] + (-1).to_bytes(4, "little", signed=True), "expectation.block_ids"),
])
def test_malformed_records_name_the_field(damage, field):
    with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.")):
        ExpectRecord.decode(damage(GOOD))
    assert ExpectRecord.decode(GOOD).transfer_id == "t"  # the control: undamaged, it decodes


def test_notices_and_hellos_are_not_expectations():
    assert not is_expectation(HELLO) and not is_expectation(ReadNotice("r", "e", 0, 1).encode())
