"""Layout views against torch's own view semantics (real CPU tensors)."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError
from kvxferd.layout.strided import Layout

from tests.layout.brute import addresses

DIMS = ("B", "H", "N", "C")


@st.composite
def permuted_tensors(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=4, max_size=4))
    order = draw(st.permutations(range(4)))
    storage = torch.arange(int(np.prod(shape)) + 7, dtype=torch.int32)
    physical = storage[7:].view([shape[i] for i in order])  # memory order = order
    logical = physical.permute([order.index(i) for i in range(4)])
    return logical


def values(layout):
    return addresses(layout)


@given(permuted_tensors(), st.data())
def test_narrow_and_select_match_torch(tensor, data):
    layout = Layout.from_tensor(tensor, DIMS)
    assert np.array_equal(addresses(layout), tensor.numpy())  # storage holds its own index
    dim = data.draw(st.integers(0, 3))
    size = tensor.shape[dim]
    start = data.draw(st.integers(0, size - 1))
    length = data.draw(st.integers(1, size - start))
    narrowed = layout.narrow(DIMS[dim], start, length)
    assert np.array_equal(addresses(narrowed), tensor.narrow(dim, start, length).numpy())
    selected = layout.select(DIMS[dim], start)
    assert np.array_equal(addresses(selected), tensor.select(dim, start).numpy())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_group_blocks_views_kernel_blocks_as_logical_blocks(k):
    num_blocks, heads, kernel, chans = 3, 2, 2, 3
    physical = torch.arange(num_blocks * k * heads * kernel * chans).view(num_blocks * k, heads, kernel, chans)
    layout = Layout.from_tensor(physical, DIMS).group_blocks(k)
    assert layout.size("B") == num_blocks and layout.size("N") == k * kernel
    got = addresses(layout, DIMS)
    for b, h, n, c in itertools.product(range(num_blocks), range(heads), range(k * kernel), range(chans)):
        assert got[b, h, n, c] == physical[b * k + n // kernel, h, n % kernel, c]
    # The block table addresses each logical block's first element.
    assert list(layout.block_table_bytes) == [int(physical[b * k, 0, 0, 0]) * 8 for b in range(num_blocks)]
    # ungroup is the inverse view: kernel block ids address kernel blocks again.
    back = layout.ungroup_blocks(k)
    assert back.size("B") == num_blocks * k and back.size("N") == kernel
    assert np.array_equal(addresses(back, DIMS), physical.numpy())


def test_ungroup_splits_logical_blocks():
    t = torch.arange(4 * 8 * 2).view(4, 8, 2)  # (B, N, C), 8 tokens per block
    kernel_view = Layout.from_tensor(t, ("B", "N", "C")).ungroup_blocks(4)  # 2-token kernel blocks
    got = addresses(kernel_view, ("B", "N", "C"))
    assert np.array_equal(got, t.view(16, 2, 2).numpy())


@pytest.mark.parametrize("kernel_blocks, k", [(2, 4), (4, 2), (2, 8), (4, 8), (1, 16)])
def test_ungroup_across_kernel_blocks(kernel_blocks, k):
    # Logical blocks of 16 tokens stored as kernel blocks; viewed as k blocks of 16 // k tokens.
    kernel = 16 // kernel_blocks
    physical = torch.arange(3 * kernel_blocks * 2 * kernel).view(3 * kernel_blocks, 2, kernel)  # (Bk, H, Nk)
    layout = Layout.from_tensor(physical, ("B", "H", "N")).group_blocks(kernel_blocks)
    units = layout.ungroup_blocks(k)
    sub = 16 // k
    got = addresses(units, ("B", "H", "N"))
    assert got.shape == (3 * k, 2, sub)
    for u, h, n in itertools.product(range(3 * k), range(2), range(sub)):
        token = (u % k) * sub + n
        assert got[u, h, n] == physical[(u // k) * kernel_blocks + token // kernel, h, token % kernel]
    assert np.array_equal(units.block_table_bytes, got[:, 0, 0] * 8)


def test_ungroup_refuses_impossible_split():
    layout = Layout.from_tensor(torch.empty(2, 3, 4, device="meta"), ("B", "N", "C")).group_blocks(1)
    with pytest.raises(InvalidArgumentError):
        layout.ungroup_blocks(2)  # 3 tokens


def test_refine_keeps_boundaries():
    layout = Layout.from_tensor(torch.empty(2, 16, device="meta"), ("B", "N")).group_blocks(2)  # N = [2, 16]
    fine = layout.refine("N", [2, 4, 4])
    assert np.array_equal(addresses(fine), addresses(layout))
    with pytest.raises(LayoutMismatchError):
        layout.refine("N", [4, 8])  # would cut through the kernel-block boundary


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dims=("B", "B"), shape=(2, 2), strides=(2, 1)), "dims"),
        (dict(dims=("B", "H"), shape=(2, 0), strides=(2, 1)), "shape[H]"),
        (dict(dims=("B", "H"), shape=(2, 2), strides=(2, -1)), "strides[H]"),
        (dict(dims=("B", "H"), shape=(2, 2), strides=(1, 1)), "strides[H]"),  # overlap
        (dict(dims=("B",), shape=(2, 2), strides=(2, 1)), "dims"),
        (dict(dims=("B", "H"), shape=(2, 2), strides=(2, 1), dtype="complex7"), "dtype"),
    ],
)
def test_bad_layouts_are_typed(kwargs, field):
    kwargs.setdefault("dtype", "bfloat16")
    with pytest.raises(InvalidArgumentError) as err:
        Layout.create(**kwargs)
    assert err.value.field == field


def test_bad_views_are_typed():
    layout = Layout.create(("B", "H"), (4, 3), (3, 1), "float32")
    with pytest.raises(InvalidArgumentError, match=r"narrow\[H\]"):
        layout.narrow("H", 2, 2)
    with pytest.raises(InvalidArgumentError, match="no dim 'X'"):
        layout.narrow("X", 0, 1)
    with pytest.raises(InvalidArgumentError, match=r"select\[B\]"):
        layout.select("B", 4)
    with pytest.raises(InvalidArgumentError, match="kernel_blocks_per_block"):
        layout.group_blocks(3, token_dim="H")
