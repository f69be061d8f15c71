"""Pairing two layouts: byte-exact against brute-force addressing."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import LayoutMismatchError, SpanBudgetError
from kvxferd.layout.builders import contiguous
from kvxferd.layout.match import common_factors, match_layouts
from kvxferd.layout.spans import SpanTable
from kvxferd.layout.strided import Layout

from tests.layout.brute import addresses
from kvxferd.rig.verify.oracle import apply_span_copies
from kvxferd.rig.verify.physical import UINTS

INNER_DIMS = ("H", "N", "KV", "C")


@st.composite
def stored(draw, sizes, num_blocks):
    """One side's storage of logical ``sizes``: any memory order, padding, kernel split."""
    dims = ["B"] + list(sizes)
    k = 1
    if "N" in sizes and draw(st.booleans()):
        k = draw(st.sampled_from([d for d in (2, 3, 4) if sizes["N"] % d == 0] or [1]))
    phys = {"B": num_blocks * k, **sizes}
    if k > 1:
        phys["N"] = sizes["N"] // k
    order = draw(st.permutations(dims))
    pads = {d: draw(st.integers(0, 2)) for d in dims}
    starts = {d: draw(st.integers(0, pads[d])) for d in dims}
    layout = contiguous(order, [phys[d] + pads[d] for d in order], "int32")
    for d in order:
        layout = layout.narrow(d, starts[d], phys[d])
    return layout.group_blocks(k) if k > 1 else layout


@st.composite
def layout_pairs(draw):
    names = draw(st.lists(st.sampled_from(INNER_DIMS), min_size=1, max_size=4, unique=True))
    sizes = {d: draw(st.integers(1, 4)) for d in names}
    local = draw(stored(sizes, draw(st.integers(1, 5))))
    remote = draw(stored(sizes, draw(st.integers(1, 5))))
    return local, remote


def check_copy(local: Layout, remote: Layout, local_ids, remote_ids):
    """Copy with the matched spans, then compare every element with brute force."""
    dims = [d for d in local.dims if d != "B"]
    table = SpanTable.from_template(match_layouts(local, remote, max_spans_per_block=10**6))
    ladd, radd = addresses(local, ["B"] + dims), addresses(remote, ["B"] + dims)
    per_block = int(np.prod([local.size(d) for d in dims]))
    element = UINTS[local.itemsize]
    top = np.iinfo(element).max
    remote_buf = np.full(radd.max() + 1, top, dtype=element)
    ids = (np.arange(remote.num_blocks * per_block) % (top - 1)).astype(element).reshape(radd.shape)
    remote_buf[radd] = ids
    local_buf = np.full(ladd.max() + 1, top - 1, dtype=element)
    pairs = table.spans(local_ids, remote_ids)
    apply_span_copies(remote_buf.view(np.uint8), local_buf.view(np.uint8), pairs)
    expected = np.full(local_buf.shape, top - 1, dtype=element)
    expected[ladd[local_ids]] = ids[remote_ids]
    assert np.array_equal(local_buf, expected), (local, remote, local_ids, remote_ids)
    return table, pairs


@given(layout_pairs(), st.data())
def test_matched_spans_copy_the_same_logical_elements(pair, data):
    local, remote = pair
    n = data.draw(st.integers(0, min(local.num_blocks, remote.num_blocks)))
    local_ids = data.draw(st.permutations(range(local.num_blocks)))[:n]
    remote_ids = data.draw(st.lists(st.integers(0, remote.num_blocks - 1), min_size=n, max_size=n))
    check_copy(local, remote, np.array(local_ids, dtype=np.int64), np.array(remote_ids, dtype=np.int64))


def hnd(order, **kw):
    sizes = dict(B=6, H=4, N=8, KV=2, C=16) | kw
    return contiguous(order, [sizes[d] for d in order], "bfloat16")


def test_same_layout_is_one_span_per_block_and_runs_merge():
    layout = hnd(("B", "H", "N", "KV", "C"))
    table, pairs = check_copy(layout, layout, np.array([0, 1, 2, 4]), np.array([1, 2, 3, 0]))
    assert table.spans_per_block == 1 and table.span_bytes == 4 * 8 * 2 * 16 * 2
    assert pairs.num_spans == 2  # blocks 0-2 <- 1-3 are one run, 4 <- 0 another


def test_hnd_vs_nhd_pairs_at_token_rows():
    local, remote = hnd(("B", "H", "N", "KV", "C")), hnd(("B", "N", "H", "KV", "C"))
    table, _ = check_copy(local, remote, np.array([3, 1]), np.array([0, 5]))
    assert table.span_bytes == 2 * 16 * 2 and table.spans_per_block == 4 * 8


def test_tp_narrowed_heads_stay_one_span_per_block():
    local = hnd(("B", "H", "N", "KV", "C"), H=2)
    remote = hnd(("B", "H", "N", "KV", "C")).narrow("H", 2, 2)
    table, _ = check_copy(local, remote, np.array([0, 1]), np.array([4, 5]))
    assert table.spans_per_block == 1


def test_budget_error_names_the_dim():
    local, remote = hnd(("B", "H", "N", "KV", "C")), hnd(("B", "N", "H", "KV", "C"))
    with pytest.raises(SpanBudgetError) as err:
        match_layouts(local, remote, max_spans_per_block=8)
    assert err.value.field == "dims[N]" and "32 spans" in str(err.value)


def test_mismatches_are_typed_and_named():
    base = hnd(("B", "H", "N", "KV", "C"))
    with pytest.raises(LayoutMismatchError) as err:
        match_layouts(base, contiguous(("B", "H", "N", "KV", "C"), (6, 4, 8, 2, 16), "float16"))
    assert err.value.field == "dtype"
    with pytest.raises(LayoutMismatchError, match=r"H: 4 vs 2"):
        match_layouts(base, hnd(("B", "H", "N", "KV", "C"), H=2))
    with pytest.raises(LayoutMismatchError, match=r"only local: \['KV'\]"):
        match_layouts(base, contiguous(("B", "H", "N", "C"), (6, 4, 8, 32), "bfloat16"))


def test_common_factors():
    assert common_factors("N", [4, 4], [16]) == [4, 4]
    assert common_factors("N", [2, 8], [4, 4]) == [2, 2, 4]
    with pytest.raises(LayoutMismatchError):
        common_factors("N", [2, 3], [3, 2])
