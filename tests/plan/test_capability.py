"""Read capabilities: one exact hold (key, request id, every group's block ids in order) per capability."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError, PermissionDeniedError
from kvxferd.plan.capability import (CAPABILITY_BYTES, KEY_ID_BYTES, check_capability, check_read_capabilities,
                                     hold_capability, key_id, sealed_by_other_keys)

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
groups = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), min_size=1, max_size=3)


@given(request_id=st.text(min_size=1, max_size=12), blocks=groups, other=groups, other_id=st.text(min_size=1, max_size=12))
def test_a_capability_seals_one_exact_hold(request_id, blocks, other, other_id):
    capability = hold_capability(KEY, request_id, blocks)
    assert len(capability) == CAPABILITY_BYTES
    check_capability(KEY, request_id, [np.asarray(g, dtype=np.int64) for g in blocks], capability, "c")  # any int type
    if (other_id, other) != (request_id, blocks):
        with pytest.raises(PermissionDeniedError):
            check_capability(KEY, other_id, other, capability, "c")
    with pytest.raises(PermissionDeniedError):
        check_capability(OTHER_KEY, request_id, blocks, capability, "c")


def test_ids_are_not_wrapped_to_32_bits():
    assert hold_capability(KEY, "r", [[2**32 + 5]]) != hold_capability(KEY, "r", [[5]])
    assert hold_capability(KEY, "r", [[-1]]) != hold_capability(KEY, "r", [[2**32 - 1]])


def test_group_boundaries_are_part_of_the_hold():
    """[1, 2] | [3] and [1] | [2, 3] are different holds (the ids alone would be the same bytes)."""
    assert hold_capability(KEY, "r", [[1, 2], [3]]) != hold_capability(KEY, "r", [[1], [2, 3]])
    assert hold_capability(KEY, "r", [[1]]) != hold_capability(KEY, "r", [[1], []])


def test_a_read_needs_every_ranks_capability_in_rank_order():
    blocks = [[4, 5]]
    caps = [hold_capability(KEY, "r", blocks), hold_capability(OTHER_KEY, "r", blocks)]
    check_read_capabilities([KEY, OTHER_KEY], "r", blocks, caps)
    for wrong, field in ((caps[::-1], "remote_capabilities[0]"), (caps[:1], "remote_capabilities"),
                         ((), "remote_capabilities")):
        with pytest.raises(PermissionDeniedError) as err:
            check_read_capabilities([KEY, OTHER_KEY], "r", blocks, wrong)
        assert err.value.field == field
    with pytest.raises(InvalidArgumentError) as err:
        check_read_capabilities([KEY, OTHER_KEY], "r", blocks, [caps[0], b"short"])
    assert err.value.field == "remote_capabilities[1]"


def test_a_capability_names_its_key_so_a_reader_can_tell_a_restarted_holder():
    caps = [hold_capability(KEY, "r", [[1]]), hold_capability(OTHER_KEY, "r", [[1]])]
    assert caps[0][:KEY_ID_BYTES] == key_id(KEY) != key_id(OTHER_KEY)
    assert not sealed_by_other_keys([KEY, OTHER_KEY], caps)
    assert sealed_by_other_keys([KEY, KEY], caps)  # rank 1 has a new key since
    assert not sealed_by_other_keys([KEY, KEY], caps[:1])  # a wrong count is refused, not re-handshaken


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16))
def test_only_its_own_push_key_opens_a_digest(key, other):
    from kvxferd.plan.capability import push_key_digest, push_key_opens

    digest = push_key_digest(key)
    assert len(digest) == 32 and push_key_opens(key, digest)
    assert push_key_opens(other, digest) == (other == key)  # the negative control: any other key fails
    assert not push_key_opens(key, b"")  # a hold placed for reads opens to no key


@pytest.mark.parametrize("bad", [b"", bytes(15), bytes(17), "0" * 16, None])
def test_push_keys_and_digests_of_the_wrong_size_are_refused(bad):
    from kvxferd.plan.capability import check_push_digest, check_push_key

    with pytest.raises(InvalidArgumentError, match="push_key"):
        check_push_key(bad, "push_key")
    if bad != b"":
        with pytest.raises(InvalidArgumentError, match="push_key_digest"):
            check_push_digest(bad, "push_key_digest")
    assert check_push_key(bytes(16), "push_key") == bytes(16) and check_push_digest(b"", "d") == b""
