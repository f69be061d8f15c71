"""Span copies in the kernel (process_vm_readv on this process) against a byte-by-byte reference."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvxferd.errors import TransferError
from kvxferd.xfer.samehost import hostcopy


def _reference(dst: np.ndarray, src: np.ndarray, dst_offsets, src_offsets, lengths) -> np.ndarray:
    out = dst.copy()
    for d, s, n in zip(dst_offsets, src_offsets, lengths):
        out[d:d + n] = src[s:s + n]
    return out


def _spans(rng: np.random.Generator, num_spans: int, max_len: int, size: int):
    """Non-overlapping destination spans in a random order; sources anywhere (they may overlap)."""
    lengths = rng.integers(0, max_len + 1, num_spans)
    gaps = rng.integers(0, 4, num_spans)
    starts = np.cumsum(gaps + lengths) - lengths
    order = rng.permutation(num_spans)
    dst_offsets, lengths = starts[order], lengths[order]
    src_offsets = rng.integers(0, size - max_len, num_spans)
    return dst_offsets, src_offsets, lengths


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_spans=st.integers(0, 2600), max_len=st.integers(1, 300))
def test_every_span_lands_where_the_reference_puts_it(seed, num_spans, max_len):
    """Up to 2 600 spans: more than IOV_MAX (1 024), so the copy crosses its chunk boundaries."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_offsets, src_offsets, lengths = _spans(rng, num_spans, max_len, len(src))
    dst = rng.integers(0, 256, int((dst_offsets + lengths).max(initial=0)) + 8, dtype=np.uint8)
    expected = _reference(dst, src, dst_offsets, src_offsets, lengths)
    copied = hostcopy.copy_spans(dst.ctypes.data + dst_offsets, src.ctypes.data + src_offsets, lengths)
    assert copied == int(lengths.sum())
    assert np.array_equal(dst, expected)


def test_the_comparison_catches_a_copy_one_byte_off():
    """Negative control: the reference check above fails for sources shifted by one byte."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst_offsets, src_offsets, lengths = _spans(rng, 50, 40, len(src))
    dst = np.zeros(int((dst_offsets + lengths).max()) + 8, np.uint8)
    expected = _reference(dst, src, dst_offsets, src_offsets, lengths)
    hostcopy.copy_spans(dst.ctypes.data + dst_offsets, src.ctypes.data + src_offsets + 1, lengths)
    assert not np.array_equal(dst, expected)


def test_a_source_page_that_is_not_mapped_is_an_error_not_a_crash():
    area = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    view = np.frombuffer(area, np.uint8)
    base = view.ctypes.data
    dst = np.zeros(64, np.uint8)
    hostcopy.copy_spans(np.array([dst.ctypes.data]), np.array([base]), np.array([64]))
    del view
    area.close()  # unmapped: the kernel refuses the read (EFAULT), the process lives on
    with pytest.raises(TransferError, match="process_vm_readv"):
        hostcopy.copy_spans(np.array([dst.ctypes.data]), np.array([base]), np.array([64]))


def test_a_copy_whose_later_span_is_not_mapped_is_an_error_after_its_prefix():
    """The kernel copies the first span and stops at the unmapped one: a short count, an error (the caller
    fails the rank), never a read reported whole."""
    area = mmap.mmap(-1, mmap.PAGESIZE)
    view = np.frombuffer(area, np.uint8)
    gone = view.ctypes.data
    del view
    area.close()
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(128, np.uint8)
    with pytest.raises(TransferError, match="copied 64 of 128 bytes"):
        hostcopy.copy_spans(np.array([dst.ctypes.data, dst.ctypes.data + 64]), np.array([src.ctypes.data, gone]),
                            np.array([64, 64]))
    assert np.array_equal(dst[:64], src)


def test_lists_of_different_lengths_are_refused():
    with pytest.raises(TransferError):
        hostcopy.copy_spans(np.array([1, 2]), np.array([1]), np.array([1, 1]))


def test_this_machine_can_copy_in_the_kernel():
    """The CPU test machines allow the call; a daemon where it is refused falls back to NIXL."""
    assert hostcopy.available()
