"""Ownership arithmetic against the definition, for every small case."""

import numpy as np
import pytest

from kvxferd.errors import TpConfigError
from kvxferd.tp.shards import holder_ranks, owned_range


def brute_owned(extent, tp_size, rank):
    if extent >= tp_size:
        return set(range(rank * extent // tp_size, (rank + 1) * extent // tp_size))
    return {rank * extent // tp_size}


@pytest.mark.parametrize("extent", [1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 100])
def test_owned_and_holders_match_definition(extent):
    for tp_size in range(1, 17):
        owned = [brute_owned(extent, tp_size, r) for r in range(tp_size)]
        for r in range(tp_size):
            start, stop = owned_range(extent, tp_size, r)
            assert set(range(start, stop)) == owned[r]
        first, stop = holder_ranks(extent, tp_size, np.arange(extent))
        for e in range(extent):
            assert set(range(first[e], stop[e])) == {r for r in range(tp_size) if e in owned[r]}
        # Every element is held by someone; split dims have exactly one owner.
        assert np.all(stop > first)
        if extent >= tp_size:
            assert np.all(stop - first == 1)


@pytest.mark.parametrize(
    "args, field",
    [((4, 2, 2), "tp_rank"), ((4, 2, -1), "tp_rank"), ((4, 0, 0), "tp_size"), ((0, 2, 0), "global_extent"), ((4, 2.0, 0), "tp_size")],
)
def test_bad_tp_arguments_name_the_field(args, field):
    with pytest.raises(TpConfigError) as err:
        owned_range(*args)
    assert err.value.field == field
