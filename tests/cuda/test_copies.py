"""Batched device copies (issue #37) against a played driver: the right spans, only once the event says so.

:class:`FakeDriver` has no kernel calls, so these run the ``cuMemcpyBatchAsync`` fallback; the tests marked
with both drivers also run the span-copy kernel's path (tests/cuda/test_spancopy.py has the rest of it)."""

from __future__ import annotations

import ctypes
import threading
import types

import numpy as np
import pytest

from kvxferd.cuda import copies
from kvxferd.cuda.copies import BatchCopier
from kvxferd.errors import TransferError, UnavailableError
from tests.cuda.fake_driver import FakeDriver
from tests.cuda.test_spancopy import KernelDriver

both_drivers = pytest.mark.parametrize("driver_class", [FakeDriver, KernelDriver])


def _spans(rng, source: np.ndarray, target: np.ndarray, num_spans: int):
    """Disjoint random spans of ``source`` to disjoint places in ``target``: (dsts, srcs, sizes), and the
    brute-force result."""
    size = 64
    slots = rng.permutation(len(source) // size)[:num_spans]
    places = rng.permutation(len(target) // size)[:num_spans]
    lengths = rng.integers(1, size + 1, num_spans)
    expected = np.zeros_like(target)
    for slot, place, length in zip(slots, places, lengths):
        expected[place * size:place * size + length] = source[slot * size:slot * size + length]
    return (target.ctypes.data + places * size, source.ctypes.data + slots * size, lengths), expected


def test_a_batch_copies_exactly_its_spans_and_only_once_its_event_ended():
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    target = np.zeros(1 << 16, np.uint8)
    driver = FakeDriver(lag=3)
    copier = BatchCopier(2, lib=driver)
    assert copier.method == "cuMemcpyBatchAsync"  # the played driver cannot load the kernel
    (dsts, srcs, sizes), expected = _spans(rng, source, target, 300)
    event = copier.submit(dsts, srcs, sizes)
    assert driver.batch_sizes == [300]  # one driver call for the whole read, not one per span
    assert driver.attributes == [(copies.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0, 1)]
    for _ in range(3):
        assert not event.done()
    assert not target.any()  # nothing may be used before the event says done
    assert event.done() and event.done()
    assert np.array_equal(target, expected)
    event.release()
    assert driver.current == 7002  # GPU 2's primary context, made current before each call
    copier.close()
    with pytest.raises(TransferError, match="closed"):
        copier.submit(dsts, srcs, sizes)


def test_negative_control_a_wrong_copy_is_seen():
    rng = np.random.default_rng(1)
    source = rng.integers(1, 256, 1 << 14, dtype=np.uint8)
    target = np.zeros(1 << 14, np.uint8)
    driver = FakeDriver(lag=0)
    driver.corrupt = True
    (dsts, srcs, sizes), expected = _spans(rng, source, target, 50)
    sizes = np.maximum(sizes, 16)
    expected = np.zeros_like(target)
    for d, s, n in zip(dsts, srcs, sizes):
        expected[d - target.ctypes.data:d - target.ctypes.data + n] = source[s - source.ctypes.data:s - source.ctypes.data + n]
    event = BatchCopier(0, lib=driver).submit(dsts, srcs, sizes)
    assert event.done()
    assert not np.array_equal(target, expected)


def test_a_refused_batch_names_the_copy_and_records_no_event():
    driver = FakeDriver()
    driver.batch_code, driver.failed_copy = 1, 17  # CUDA_ERROR_INVALID_VALUE
    copier = BatchCopier(0, lib=driver)
    with pytest.raises(TransferError, match=r"CUresult 1, copy 17 of 3"):
        copier.submit(np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([1, 1, 1]))
    assert "cuEventRecord" not in driver.calls
    driver.failed_copy = None
    with pytest.raises(TransferError, match=r"\(CUresult 1\)"):
        copier.submit(np.array([1]), np.array([4]), np.array([1]))
    with pytest.raises(TransferError, match="differ in length"):
        copier.submit(np.array([1, 2]), np.array([4]), np.array([1]))


@both_drivers
def test_a_device_error_ends_the_batch_as_a_transfer_error(driver_class):
    driver = driver_class()
    copier = BatchCopier(0, lib=driver)
    buffer = np.zeros(64, np.uint8)
    event = copier.submit(np.array([buffer.ctypes.data]), np.array([buffer.ctypes.data + 32]), np.array([8]))
    driver.event_code = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(TransferError, match="700"):
        event.done()


def test_releasing_a_running_batch_waits_for_it_and_close_waits_for_the_stream():
    """The engine may reuse the blocks once the read ended: no copy may still write into them then."""
    driver = FakeDriver(lag=100)
    copier = BatchCopier(0, lib=driver)
    source, target = np.arange(1, 65, dtype=np.uint8), np.zeros(64, np.uint8)
    event = copier.submit(np.array([target.ctypes.data]), np.array([source.ctypes.data]), np.array([64]))
    assert not event.done()
    event.release()
    assert np.array_equal(target, source) and "cuEventSynchronize" in driver.calls
    second = np.zeros(64, np.uint8)
    copier.submit(np.array([second.ctypes.data]), np.array([source.ctypes.data]), np.array([64]))
    copier.close()
    assert np.array_equal(second, source)
    assert driver.calls[-4:] == ["cuStreamSynchronize", "cuStreamDestroy", "cuMemFree", "cuDevicePrimaryCtxRelease"]
    copier.close()  # twice: nothing more
    assert driver.calls.count("cuDevicePrimaryCtxRelease") == 1


def test_an_empty_batch_is_only_an_event():
    driver = FakeDriver(lag=0)
    event = BatchCopier(0, lib=driver).submit(np.zeros(0), np.zeros(0), np.zeros(0))
    assert event.done() and "cuMemcpyBatchAsync" not in driver.calls


def test_a_driver_without_the_batch_call_nor_kernel_calls_is_unavailable():
    with pytest.raises(UnavailableError, match="12.8"):
        copies._typed(types.SimpleNamespace())
    with pytest.raises(UnavailableError, match="12.8"):
        copies._typed(ctypes.CDLL(None))  # a real library without the symbol: libc


def test_without_a_gpu_driver_a_copier_cannot_be_made():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(UnavailableError):
            BatchCopier(0)
    else:
        pytest.skip("this machine has a CUDA driver: tests/gpu covers the copier")


@both_drivers
def test_every_thread_that_submits_or_polls_gets_the_context_made_current(driver_class):
    """A daemon posts on its event loop and polls on its data-plane thread: CUDA's current context is per
    thread, so each call makes it current first (else the driver would use none, or another GPU's)."""
    driver = driver_class(lag=1)
    copier = BatchCopier(1, lib=driver)
    source, target = np.arange(1, 33, dtype=np.uint8), np.zeros(32, np.uint8)
    events, errors = [], []

    def submit():
        try:
            events.append(copier.submit(np.array([target.ctypes.data]), np.array([source.ctypes.data]),
                                        np.array([32])))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=submit)
    thread.start()
    thread.join()
    assert not errors, errors

    def poll():
        try:
            while not events[0].done():
                pass
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=poll)
    thread.start()
    thread.join()
    assert not errors and np.array_equal(target, source)


@both_drivers
def test_the_check_copy_reads_a_few_bytes_of_an_allocation_and_a_fault_breaks_the_copier(driver_class):
    driver = driver_class(lag=5)
    copier = BatchCopier(0, lib=driver)
    allocation = np.arange(256, dtype=np.uint8)
    copier.check_source(allocation.ctypes.data, allocation.nbytes)  # waits: no lag counts
    assert np.array_equal(driver.scratch[0], allocation[:copies.CHECK_BYTES])
    event = copier.submit(np.array([driver.scratch[0].ctypes.data]), np.array([allocation.ctypes.data]), np.array([8]))
    driver.event_code = 700
    with pytest.raises(TransferError, match="700"):
        event.done()
    assert "700" in copier.broken  # the context is poisoned: nothing more runs on it
    with pytest.raises(TransferError, match="700"):
        copier.submit(np.array([1]), np.array([2]), np.array([1]))


def test_the_driver_calls_are_typed_as_the_cuda_12_8_header_has_them():
    """The ABI the real driver sees (the played one skips it): 9 arguments with failIdx, and the attribute
    struct's layout (CUmemcpyAttributes_v1: 24 bytes)."""
    fake = types.SimpleNamespace(**{name: types.SimpleNamespace() for name in (
        "cuMemcpyBatchAsync", "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent", "cuMemAlloc_v2", "cuMemFree_v2", "cuStreamCreate", "cuStreamSynchronize",
        "cuStreamDestroy_v2", "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize",
        "cuEventDestroy_v2")})
    typed = copies._typed(fake)
    assert len(typed.cuMemcpyBatchAsync.argtypes) == 9
    assert typed.cuMemcpyBatchAsync.argtypes[7] == ctypes.POINTER(ctypes.c_size_t)  # failIdx
    assert ctypes.sizeof(copies.MemcpyAttributes) == 24
    assert [getattr(copies.MemcpyAttributes, f).offset for f in ("src_access_order", "src_location", "dst_location",
                                                                   "flags")] == [0, 4, 12, 20]


def test_the_kernel_calls_are_typed_as_the_cuda_12_header_has_them():
    """A driver with the kernel's calls and no batch call (CUDA 12.0 to 12.7) is usable: cuLaunchKernel's 11
    arguments with kernelParams and extra as void**, and a 64-bit device address for the table's upload."""
    fake = types.SimpleNamespace(**{name: types.SimpleNamespace() for name in (
        "cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload", "cuLaunchKernel", "cuMemcpyHtoDAsync_v2",
        "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent",
        "cuMemAlloc_v2", "cuMemFree_v2", "cuStreamCreate", "cuStreamSynchronize", "cuStreamDestroy_v2",
        "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2")})
    typed = copies._typed(fake)
    launch = typed.cuLaunchKernel.argtypes
    assert len(launch) == 11 and launch[1:8] == [ctypes.c_uint] * 7
    assert launch[9] == launch[10] == ctypes.POINTER(ctypes.c_void_p)
    assert typed.cuMemcpyHtoDAsync_v2.argtypes[0] == ctypes.c_uint64
    assert typed.cuModuleLoadData.argtypes[1] == ctypes.c_char_p  # the PTX, NUL-terminated
    assert not hasattr(typed, "cuMemcpyBatchAsync")
