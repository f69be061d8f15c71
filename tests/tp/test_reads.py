"""Read slices and notifications against a brute-force reference.

Exhaustive over TP sizes 1..16 on both sides for the head counts models
use, plus hypothesis for arbitrary extents.
"""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import TpConfigError
from kvxferd.tp.reads import TpPairing, read_slices
from kvxferd.tp.shards import owned_range

from tests.tp.test_shards import brute_owned

EXTENTS = [1, 2, 3, 4, 5, 7, 8, 16, 32]


def check_pairing(extent, local_tp, remote_tp):
    remote_owned = [brute_owned(extent, remote_tp, q) for q in range(remote_tp)]
    reads_per_element_holder = Counter()
    for r in range(local_tp):
        needed = brute_owned(extent, local_tp, r)
        lo = min(needed)
        got = []
        for s in read_slices(extent, local_tp, r, remote_tp):
            elements = range(s.global_start, s.global_stop)
            assert s.num_elements >= 1
            assert set(elements) <= remote_owned[s.remote_rank], (extent, local_tp, r, remote_tp, s)
            assert s.local_start == s.global_start - lo
            assert s.remote_start == s.global_start - min(remote_owned[s.remote_rank])
            got.extend(elements)
            for e in elements:
                reads_per_element_holder[(e, s.remote_rank)] += 1
        # Each needed element is read exactly once, in order.
        assert got == sorted(needed), (extent, local_tp, r, remote_tp)
    # Replica choice is balanced: for every element, reads over its holders differ by <= 1.
    for e in range(extent):
        holders = [q for q in range(remote_tp) if e in remote_owned[q]]
        counts = [reads_per_element_holder[(e, q)] for q in holders]
        assert max(counts) - min(counts) <= 1, (extent, local_tp, remote_tp, e, counts)


def check_notifications(extents, local_tp, remote_tp):
    pairing = TpPairing(local_tp, remote_tp, tuple(extents))
    notifiers = Counter()
    for r in range(local_tp):
        expected = {
            q for q in range(remote_tp) for g in extents
            if brute_owned(g, remote_tp, q) & brute_owned(g, local_tp, r)
        }
        assert set(pairing.notify_ranks(r)) == expected
        read_ranks = {s.remote_rank for i in range(len(extents)) for s in pairing.read_slices(i, r)}
        assert read_ranks <= expected  # everyone we read from is notified
        notifiers.update(expected)
    for q in range(remote_tp):
        assert pairing.num_notifiers(q) == notifiers[q] >= 1  # nobody is left waiting forever


@pytest.mark.parametrize("extent", EXTENTS)
def test_every_tp_pair_reads_each_element_once(extent):
    for local_tp in range(1, 17):
        for remote_tp in range(1, 17):
            check_pairing(extent, local_tp, remote_tp)
            check_notifications([extent], local_tp, remote_tp)


@given(
    extent=st.integers(1, 5000),
    local_tp=st.integers(1, 16),
    remote_tp=st.integers(1, 16),
)
def test_arbitrary_extents(extent, local_tp, remote_tp):
    check_pairing(extent, local_tp, remote_tp)


@given(
    extents=st.lists(st.integers(1, 64), min_size=1, max_size=4),
    local_tp=st.integers(1, 16),
    remote_tp=st.integers(1, 16),
)
def test_multi_piece_notifications(extents, local_tp, remote_tp):
    """Mamba: x heads, B/C groups and SSM heads are sharded independently."""
    check_notifications(extents, local_tp, remote_tp)


def test_replicated_cache_reads_one_replica_but_notifies_all():
    # MLA-like: one virtual element; 4 prefill ranks, 1 decode rank.
    pairing = TpPairing(1, 4, (1,))
    slices = pairing.read_slices(0, 0)
    assert [s.remote_rank for s in slices] == [0]
    assert pairing.notify_ranks(0) == (0, 1, 2, 3)
    # 2 decode ranks spread over the replicas.
    assert [read_slices(1, 2, r, 4)[0].remote_rank for r in range(2)] == [0, 1]


def test_heterogeneous_example_from_docstring():
    assert [(s.remote_rank, s.global_start, s.global_stop) for s in read_slices(8, 3, 1, 2)] == [(0, 2, 4), (1, 4, 5)]
    assert owned_range(8, 3, 1) == (2, 5)


def test_bad_input_is_typed():
    with pytest.raises(TpConfigError) as err:
        read_slices(8, 2, 2, 4)
    assert err.value.field == "local_tp_rank"
    with pytest.raises(TpConfigError) as err:
        TpPairing(2, 0, (8,))
    assert err.value.field == "remote_tp_size"
    with pytest.raises(TpConfigError) as err:
        TpPairing(2, 2, (8, 0))
    assert err.value.field == "global_extents[1]"
    with pytest.raises(TpConfigError):
        TpPairing(2, 2, (8,)).notify_ranks(5)
