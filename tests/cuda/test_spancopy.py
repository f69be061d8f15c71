"""The span-copy kernel's host side (issue #37), without a GPU: the chunk table against a brute-force
reference, the copier's uploads and launches against a played driver, the PTX's interface, and the
ctypes calls against a C stand-in for the driver. tests/gpu runs the kernel itself on a GPU."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.cuda import copies, spancopy, spancopy_ptx
from kvxferd.cuda.copies import BatchCopier, BatchRefused
from kvxferd.errors import TransferError, UnavailableError
from tests.cuda.fake_driver import FakeDriver


# ---- the chunk table -------------------------------------------------------------------------------------
def reference_chunks(dsts, srcs, sizes, chunk_bytes: int) -> np.ndarray:
    """Brute force: every span cut at multiples of ``chunk_bytes`` from its start, one chunk at a time."""
    rows = [(d + offset, s + offset, min(chunk_bytes, n - offset))
            for d, s, n in zip(map(int, dsts), map(int, srcs), map(int, sizes)) for offset in range(0, n, chunk_bytes)]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3).T


def reference_word_bytes(dst: int, src: int) -> int:
    return next((w for w in (16, 8, 4) if dst % w == 0 and src % w == 0), 1)


def assert_tiles(dsts, srcs, sizes, table: np.ndarray, chunk_bytes: int) -> None:
    """Chunks in span order tile each span exactly: consecutive, none empty or over ``chunk_bytes``, all but
    a span's last one full, each as aligned (the kernel's word size) as its span."""
    i = 0
    for d, s, n in zip(map(int, dsts), map(int, srcs), map(int, sizes)):
        offset = 0
        while offset < n:
            dst, src, size = (int(v) for v in table[:, i])
            assert (dst, src) == (d + offset, s + offset), f"chunk {i} is not where its span continues"
            assert 0 < size <= chunk_bytes and (size == chunk_bytes or offset + size == n), f"chunk {i}: {size} B"
            assert reference_word_bytes(dst, src) == reference_word_bytes(d, s), f"chunk {i} lost alignment"
            offset, i = offset + size, i + 1
        assert offset == n, "the chunks overrun their span"
    assert i == table.shape[1], "chunks beyond the spans"


any_address = st.integers(0, 1 << 48)
aligned_address = st.integers(0, 1 << 44).map(lambda a: 16 * a)
spans = st.lists(st.tuples(st.one_of(any_address, aligned_address), st.one_of(any_address, aligned_address),
                           st.one_of(st.integers(1, 300 << 10), st.just(0))), max_size=20)


@given(spans, st.one_of(st.integers(64, 8192).map(lambda k: 16 * k), st.just(spancopy.CHUNK_BYTES)))
def test_chunks_tile_every_span_in_order_as_the_brute_force_does(span_list, chunk_bytes):
    dsts, srcs, sizes = (np.array(column, dtype=np.uint64) for column in zip(*span_list)) if span_list else [[]] * 3
    table = spancopy.chunk_spans(dsts, srcs, sizes, chunk_bytes)
    assert table.dtype == np.uint64 and table.flags.c_contiguous and table.shape[0] == 3
    assert np.array_equal(table, reference_chunks(dsts, srcs, sizes, chunk_bytes))
    assert_tiles(dsts, srcs, sizes, table, chunk_bytes)


@given(st.lists(st.tuples(any_address, any_address), min_size=1, max_size=50))
def test_the_word_size_is_the_widest_both_addresses_allow(pairs):
    dsts, srcs = (np.array(column, dtype=np.uint64) for column in zip(*pairs))
    assert spancopy.word_bytes(dsts, srcs).tolist() == [reference_word_bytes(d, s) for d, s in pairs]


def test_a_big_span_spreads_over_many_chunks_and_chunk_sizes_keep_alignment():
    table = spancopy.chunk_spans([1 << 40], [1 << 41], [512 << 20])
    assert table.shape == (3, 8192) and set(table[2].tolist()) == {spancopy.CHUNK_BYTES}
    assert spancopy.chunk_spans([0], [16], [15], 16).tolist() == [[0], [16], [15]]
    for bad in (0, 24, -16):
        with pytest.raises(ValueError, match="multiple of 16"):
            spancopy.chunk_spans([0], [0], [1], bad)


@pytest.mark.parametrize("bug", ["short last chunk", "oversized chunk", "swapped chunks", "misaligned chunk"])
def test_negative_control_chunker_bugs_are_caught(bug):
    dsts, srcs, sizes, chunk_bytes = [1 << 20, 5 << 20], [9 << 20, 3 << 20], [200_000, 70_000], 65536
    table = spancopy.chunk_spans(dsts, srcs, sizes, chunk_bytes).copy()
    if bug == "short last chunk":
        table[2, 3] -= 1
    elif bug == "oversized chunk":  # two chunks merged into one
        table = np.delete(table, 1, axis=1)
        table[2, 0] = 2 * chunk_bytes
    elif bug == "swapped chunks":
        table[:, [1, 2]] = table[:, [2, 1]]
    else:  # a chunk size that is not a multiple of 16 shifts the next chunk off the span's alignment
        table[2, 0] -= 8
        table[:2, 1] -= 8
        table[2, 1] += 8
    assert not np.array_equal(table, reference_chunks(dsts, srcs, sizes, chunk_bytes))
    with pytest.raises(AssertionError):
        assert_tiles(dsts, srcs, sizes, table, chunk_bytes)


# ---- the copier's launches, against a played driver -------------------------------------------------------
class KernelDriver(FakeDriver):
    """:class:`FakeDriver` with the span-copy kernel's calls. Uploads and launches wait on the stream like
    the batch copies; a launch reads its parameters when it is made (as the driver does) and, when the
    stream gets to it, plays the kernel on the table it reads from device memory then: each block copies
    the chunks ``block, block + grid, ...``. ``module_code``/``upload_code``/``launch_code`` refuse."""

    def __init__(self, lag: int = 2) -> None:
        super().__init__(lag)
        self.module_code = self.upload_code = self.launch_code = 0
        self.entries: list[str] = []
        self.loaded: list[int] = []
        self.freed: set[int] = set()
        self.uploads: list[tuple[int, int]] = []  # (device address, bytes)
        self.launches: list[tuple[int, int, int, int]] = []  # (blocks, threads, table address, chunks)

    def cuModuleLoadData(self, module, image):
        self._record("cuModuleLoadData")
        assert self.current is not None, "no context current on this thread"
        if self.module_code:
            return self.module_code
        self.entries = re.findall(r"\.entry\s+(\w+)", image.decode())
        module._obj.value = self._handle()
        self.loaded.append(module._obj.value)
        return 0

    def cuModuleGetFunction(self, function, module, name):
        self._record("cuModuleGetFunction")
        if module.value not in self.loaded or name.decode() not in self.entries:
            return 500  # CUDA_ERROR_NOT_FOUND
        function._obj.value = self._handle()
        return 0

    def cuModuleUnload(self, module):
        self._record("cuModuleUnload")
        self.loaded.remove(module.value)
        return 0

    def cuMemFree_v2(self, pointer):
        self.freed.add(pointer.value)
        return super().cuMemFree_v2(pointer)

    def _in_allocation(self, address: int, num_bytes: int) -> None:
        assert any(b.ctypes.data <= address and address + num_bytes <= b.ctypes.data + b.nbytes
                   and b.ctypes.data not in self.freed for b in self.scratch), "outside every live allocation"

    def cuMemcpyHtoDAsync_v2(self, dst, src, num_bytes, stream):
        self._record("cuMemcpyHtoDAsync")
        assert self.current is not None, "no context current on this thread"
        if self.upload_code:
            return self.upload_code
        self._in_allocation(dst, num_bytes)
        self.uploads.append((dst, num_bytes))
        self.pending.append((None, lambda: ctypes.memmove(dst, src, num_bytes)))
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self._record("cuLaunchKernel")
        assert self.current is not None, "no context current on this thread"
        if self.launch_code:
            return self.launch_code
        assert (gy, gz, by, bz, shared, extra) == (1, 1, 1, 1, 0, None)
        assert 0 < gx <= 65535 and bx == spancopy.THREADS_PER_BLOCK
        table, num_chunks = (ctypes.c_uint64.from_address(params[i]).value for i in range(2))  # .param .u64 x2
        self._in_allocation(table, 3 * 8 * num_chunks)
        self.launches.append((gx, bx, table, num_chunks))
        self.pending.append((None, lambda: self._kernel(table, num_chunks, gx)))
        return 0

    def _kernel(self, address: int, num_chunks: int, num_blocks: int) -> None:
        table = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * num_chunks)).from_address(address))
        table = table.reshape(3, num_chunks).copy()
        for block in range(num_blocks):
            for chunk in range(block, num_chunks, num_blocks):
                dst, src, size = (int(v) for v in table[:, chunk])
                ctypes.memmove(dst, src, size - 8 if self.corrupt and size > 8 else size)

    def _run(self, event: int) -> None:
        while any(e == event for e, _ in self.pending):
            done_event, work = self.pending.pop(0)
            if callable(work):
                work()
            else:
                for dst, src, size in work:
                    ctypes.memmove(dst, src, size - 8 if self.corrupt and size > 8 else size)
            self.events[done_event] = 0


class EagerUploadDriver(KernelDriver):
    """A wrong copier's view of the stream: the table upload lands at once, not in stream order."""

    def cuMemcpyHtoDAsync_v2(self, dst, src, num_bytes, stream):
        self.uploads.append((dst, num_bytes))
        ctypes.memmove(dst, src, num_bytes)
        return 0


class NoBatchCallDriver(KernelDriver):
    """A driver before CUDA 12.8: kernels, but no cuMemcpyBatchAsync."""

    @property
    def cuMemcpyBatchAsync(self):
        raise AttributeError("cuMemcpyBatchAsync")


def random_spans(rng, source: np.ndarray, target: np.ndarray, num_spans: int, max_bytes: int):
    """Spans of random lengths (1..max_bytes) and alignments from anywhere in ``source`` to disjoint places
    in ``target``, in shuffled order: (dsts, srcs, sizes) and the brute-force result."""
    sizes = rng.integers(1, max_bytes + 1, num_spans)
    gaps = rng.integers(0, 64, num_spans)
    places = np.cumsum(gaps + sizes) - sizes
    assert places[-1] + sizes[-1] <= len(target)
    starts = rng.integers(0, len(source) - sizes)
    order = rng.permutation(num_spans)
    expected = target.copy()
    for place, start, size in zip(places, starts, sizes):
        expected[place:place + size] = source[start:start + size]
    return (target.ctypes.data + places[order], source.ctypes.data + starts[order], sizes[order]), expected


def test_one_launch_copies_every_span_and_only_once_its_event_ended():
    rng = np.random.default_rng(0)
    source, target = rng.integers(0, 256, 4 << 20, dtype=np.uint8), np.zeros(8 << 20, np.uint8)
    driver = KernelDriver(lag=3)
    copier = BatchCopier(1, lib=driver)
    assert copier.method == "kernel"
    (dsts, srcs, sizes), expected = random_spans(rng, source, target, 40, 150 << 10)
    event = copier.submit(dsts, srcs, sizes)
    num_chunks = reference_chunks(dsts, srcs, sizes, spancopy.CHUNK_BYTES).shape[1]
    table_address = driver.scratch[1].ctypes.data  # after the check scratch: made once, at start
    assert driver.launches == [(num_chunks, spancopy.THREADS_PER_BLOCK, table_address, num_chunks)]
    assert driver.uploads == [(table_address, 3 * 8 * num_chunks)] and "cuMemcpyBatchAsync" not in driver.calls
    for _ in range(3):
        assert not event.done()
    assert not target.any()
    assert event.done() and np.array_equal(target, expected)
    event.release()
    assert driver.current == 7001
    copier.close()
    assert driver.loaded == [] and table_address in driver.freed
    assert driver.calls[-6:] == ["cuStreamSynchronize", "cuMemFree", "cuModuleUnload", "cuStreamDestroy", "cuMemFree",
                                 "cuDevicePrimaryCtxRelease"]


@pytest.mark.parametrize("driver_class", [KernelDriver, EagerUploadDriver])
def test_back_to_back_batches_share_the_table_buffer_in_stream_order(driver_class):
    """The next batch's upload overwrites the table only after the launch before it ran (the stream orders
    them); with an upload that lands at once (the negative control) the first batch copies the second's."""
    rng = np.random.default_rng(1)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    targets = [np.zeros(1 << 20, np.uint8) for _ in range(2)]
    driver = driver_class(lag=2)
    copier = BatchCopier(0, lib=driver)
    batches = [random_spans(rng, source, target, 30, 20 << 10) for target in targets]
    events = [copier.submit(*spans) for spans, _ in batches]
    assert driver.uploads[0][0] == driver.uploads[1][0]  # one buffer
    for event in events:
        event.wait()
    results = [np.array_equal(target, expected) for target, (_, expected) in zip(targets, batches)]
    assert results == ([True, True] if driver_class is KernelDriver else [False, True])


def test_a_bigger_table_grows_the_buffer_once_the_stream_ended_and_blocks_stride(monkeypatch):
    monkeypatch.setattr(spancopy, "MIN_TABLE_CHUNKS", 4)
    monkeypatch.setattr(spancopy, "MAX_BLOCKS", 3)
    rng = np.random.default_rng(2)
    source, target = rng.integers(0, 256, 2 << 20, dtype=np.uint8), np.zeros(2 << 20, np.uint8)
    driver = KernelDriver(lag=1)
    copier = BatchCopier(0, lib=driver)
    old_table = driver.scratch[1].ctypes.data
    assert driver.scratch[1].nbytes == 3 * 8 * 4
    event = copier.submit([target.ctypes.data + 5], [source.ctypes.data + 3], [(1 << 20) + 5])  # 17 chunks
    assert driver.scratch[2].nbytes == 3 * 8 * 17 and old_table in driver.freed
    calls = driver.calls[driver.calls.index("cuMemFree"):]
    assert driver.calls[driver.calls.index("cuMemFree") - 1] == "cuStreamSynchronize"  # none may still read it
    assert calls[:3] == ["cuMemFree", "cuMemcpyHtoDAsync", "cuLaunchKernel"]
    assert driver.launches[-1] == (3, spancopy.THREADS_PER_BLOCK, driver.scratch[2].ctypes.data, 17)
    event.wait()
    assert np.array_equal(target[5:(1 << 20) + 10], source[3:(1 << 20) + 8]) and not target[:5].any()


@pytest.mark.parametrize("refusal", ["launch_code", "upload_code"])
def test_a_refused_launch_is_a_refused_batch_and_the_copier_goes_on(refusal):
    driver = KernelDriver(lag=0)
    copier = BatchCopier(0, lib=driver)
    source, target = np.arange(1, 65, dtype=np.uint8), np.zeros(64, np.uint8)
    setattr(driver, refusal, 1)
    with pytest.raises(BatchRefused, match=r"(cuLaunchKernel|cuMemcpyHtoDAsync) refused .*CUresult 1"):
        copier.submit([target.ctypes.data], [source.ctypes.data], [64])
    assert "cuEventRecord" not in driver.calls and driver.calls[-1] == "cuStreamSynchronize"
    assert not copier.broken and not driver.pending
    setattr(driver, refusal, 0)
    copier.submit([target.ctypes.data], [source.ctypes.data], [64]).wait()
    assert np.array_equal(target, source)


def test_a_device_fault_after_a_launch_breaks_the_copier():
    driver = KernelDriver()
    copier = BatchCopier(0, lib=driver)
    buffer = np.zeros(64, np.uint8)
    event = copier.submit([buffer.ctypes.data], [buffer.ctypes.data + 32], [8])
    driver.event_code = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(TransferError, match="700"):
        event.done()
    assert "700" in copier.broken
    with pytest.raises(TransferError, match="700"):
        copier.submit([1], [2], [1])


def test_empty_batches_and_spans_launch_nothing():
    driver = KernelDriver(lag=0)
    copier = BatchCopier(0, lib=driver)
    assert copier.submit(np.zeros(0), np.zeros(0), np.zeros(0)).done()
    assert copier.submit([8], [16], [0]).done()
    assert "cuLaunchKernel" not in driver.calls and "cuMemcpyHtoDAsync" not in driver.calls
    source, target = np.arange(1, 33, dtype=np.uint8), np.zeros(32, np.uint8)
    copier.submit([target.ctypes.data, 8], [source.ctypes.data, 16], [32, 0]).wait()
    assert driver.launches[0][3] == 1 and np.array_equal(target, source)


@pytest.mark.parametrize("failure", ["module", "function"])
def test_a_kernel_that_does_not_load_falls_back_to_the_batch_call(failure, monkeypatch, caplog):
    driver = KernelDriver(lag=0)
    if failure == "module":
        driver.module_code = 222  # CUDA_ERROR_UNSUPPORTED_PTX_VERSION: a driver older than the PTX
    else:
        monkeypatch.setattr(spancopy, "KERNEL_NAME", b"no_such_kernel")
    with caplog.at_level(logging.WARNING, logger="kvxferd.cuda.copies"):
        copier = BatchCopier(0, lib=driver)
    assert copier.method == "cuMemcpyBatchAsync" and "does not load" in caplog.text
    assert driver.loaded == [] and len(driver.scratch) == 1  # nothing of the kernel stays
    source, target = np.arange(1, 65, dtype=np.uint8), np.zeros(64, np.uint8)
    copier.submit([target.ctypes.data], [source.ctypes.data], [64]).wait()
    assert np.array_equal(target, source) and driver.batch_sizes == [1] and "cuLaunchKernel" not in driver.calls


def test_a_driver_without_the_batch_call_copies_with_the_kernel_or_is_unavailable():
    driver = NoBatchCallDriver(lag=0)
    assert BatchCopier(0, lib=driver).method == "kernel"
    driver = NoBatchCallDriver(lag=0)
    driver.module_code = 218  # CUDA_ERROR_INVALID_PTX
    with pytest.raises(UnavailableError, match="12.8"):
        BatchCopier(0, lib=driver)
    assert driver.calls[-1] == "cuDevicePrimaryCtxRelease"


def test_negative_control_a_wrong_kernel_copy_is_seen():
    rng = np.random.default_rng(3)
    source, target = rng.integers(1, 256, 1 << 20, dtype=np.uint8), np.zeros(1 << 20, np.uint8)
    driver = KernelDriver(lag=0)
    driver.corrupt = True
    (dsts, srcs, sizes), expected = random_spans(rng, source, target, 20, 20 << 10)
    BatchCopier(0, lib=driver).submit(dsts, srcs, np.maximum(sizes, 16)).wait()
    assert not np.array_equal(target, expected)


def test_negative_control_a_chunker_bug_is_seen_end_to_end(monkeypatch):
    real = spancopy.chunk_spans

    def short_last_chunks(*args, **kwargs):
        table = real(*args, **kwargs)
        table[2] -= (table[2] < spancopy.CHUNK_BYTES) & (table[2] > 1)  # each span's last byte left out
        return table

    monkeypatch.setattr(spancopy, "chunk_spans", short_last_chunks)
    rng = np.random.default_rng(4)
    source, target = rng.integers(1, 256, 1 << 20, dtype=np.uint8), np.zeros(2 << 20, np.uint8)
    (dsts, srcs, sizes), expected = random_spans(rng, source, target, 20, 100 << 10)
    BatchCopier(0, lib=KernelDriver(lag=0)).submit(dsts, srcs, sizes).wait()
    assert not np.array_equal(target, expected)


# ---- the PTX: what the copier launches and packs must be what it declares -----------------------------------
PTX = spancopy_ptx.PTX


def test_the_ptx_was_generated_from_the_source_as_it_is():
    assert spancopy_ptx.CU_SHA256 == spancopy_ptx.source_sha256(), (
        "spancopy.cu changed: regenerate the PTX with the command in kvxferd/cuda/spancopy_ptx.py")


def test_the_ptx_entry_takes_what_the_launch_packs():
    entries = re.findall(r"\.visible \.entry (\w+)\(([^)]*)\)\s*\.maxntid (\d+), 1, 1", PTX)
    assert [name for name, _, _ in entries] == [spancopy.KERNEL_NAME.decode()]
    (_, params, max_threads), = entries
    assert re.findall(r"\.param \.(\w+)", params) == ["u64", "u64"]  # table address, num_chunks: two c_uint64
    assert int(max_threads) == spancopy.THREADS_PER_BLOCK
    cu = spancopy_ptx.SOURCE.read_text()
    assert f"#define THREADS_PER_BLOCK {spancopy.THREADS_PER_BLOCK}" in cu


def test_the_ptx_loads_on_cuda_12_drivers_without_linking():
    version = re.search(r"^\.version (\d+)\.(\d+)$", PTX, re.M)
    assert (int(version[1]), int(version[2])) <= (8, 0)  # CUDA 12.0's PTX ISA
    assert re.search(r"^\.target sm_70$", PTX, re.M) and re.search(r"^\.address_size 64$", PTX, re.M)
    assert not re.search(r"\bcall\b|\.extern", PTX)  # cuModuleLoadData links nothing in


def _tool(variable: str, name: str) -> str | None:
    return os.environ.get(variable) or shutil.which(name)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_ptxas_assembles_the_ptx(arch, tmp_path):
    """Needs NVIDIA's ptxas (skipped without it; CI normally has none). To run it::

        python3 -m pip install --target /tmp/nvcc12 nvidia-cuda-nvcc-cu12==12.0.140
        KVXFERD_PTXAS=/tmp/nvcc12/nvidia/cuda_nvcc/bin/ptxas pytest tests/cuda/test_spancopy.py -k ptxas

    (ptxas 12.0 knows no sm_100: that case is skipped with it; a CUDA 12.8+ ptxas runs both.)"""
    ptxas = _tool("KVXFERD_PTXAS", "ptxas")
    if ptxas is None:
        pytest.skip("no ptxas (set KVXFERD_PTXAS or put it on PATH)")
    (tmp_path / "spancopy.ptx").write_text(PTX)
    run = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", str(tmp_path / "spancopy.cubin"),
                          str(tmp_path / "spancopy.ptx")], capture_output=True, text=True, timeout=120)
    if run.returncode and f"'{arch}' is not defined" in run.stderr:
        pytest.skip(f"this ptxas does not know {arch}")
    assert run.returncode == 0, run.stderr
    assert "0 bytes spill stores" in run.stderr and (tmp_path / "spancopy.cubin").stat().st_size


def test_nvrtc_regenerates_the_same_ptx():
    """Needs NVRTC 12.0 (skipped without it). To run it::

        python3 -m pip install --target /tmp/nvrtc12 nvidia-cuda-nvrtc-cu12==12.0.140
        KVXFERD_NVRTC=/tmp/nvrtc12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 pytest tests/cuda/test_spancopy.py -k nvrtc
    """
    nvrtc = os.environ.get("KVXFERD_NVRTC")
    if not nvrtc:
        pytest.skip("set KVXFERD_NVRTC to a libnvrtc.so.12 (12.0)")
    ptx, version = spancopy_ptx.compile_ptx(nvrtc)
    assert version == spancopy_ptx.NVRTC_VERSION and ptx == PTX


# ---- the real ctypes calls, against a C stand-in for libcuda ----------------------------------------------
C_DRIVER = r"""
#include <stdlib.h>
#include <string.h>
typedef unsigned long long u64;
u64 launch_params[2]; unsigned launch_geometry[7]; int extra_is_null = -1; u64 image_bytes;
char function_name[64];
int cuInit(unsigned f) { return 0; }
int cuDeviceGet(int* d, int o) { *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)(long)(7000 + d); return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { return 0; }
int cuCtxSetCurrent(void* c) { return 0; }
int cuMemAlloc_v2(u64* p, size_t n) { *p = (u64)calloc(n, 1); return *p ? 0 : 2; }
int cuMemFree_v2(u64 p) { free((void*)p); return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = (void*)1; return 0; }
int cuStreamSynchronize(void* s) { return 0; }
int cuStreamDestroy_v2(void* s) { return 0; }
int cuEventCreate(void** e, unsigned f) { *e = (void*)2; return 0; }
int cuEventRecord(void* e, void* s) { return 0; }
int cuEventQuery(void* e) { return 0; }
int cuEventSynchronize(void* e) { return 0; }
int cuEventDestroy_v2(void* e) { return 0; }
int cuModuleLoadData(void** m, const void* image) {
    image_bytes = strlen(image);
    if (!strstr(image, ".entry kvx_span_copy(")) return 218;
    *m = (void*)3; return 0;
}
int cuModuleGetFunction(void** f, void* m, const char* name) { strncpy(function_name, name, 63); *f = (void*)4; return 0; }
int cuModuleUnload(void* m) { return 0; }
int cuMemcpyHtoDAsync_v2(u64 dst, const void* src, size_t n, void* s) { memcpy((void*)dst, src, n); return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void* s, void** params, void** extra) {
    unsigned geometry[7] = {gx, gy, gz, bx, by, bz, shared};
    memcpy(launch_geometry, geometry, sizeof geometry);
    extra_is_null = extra == 0;
    u64 n = *(u64*)params[1];
    const u64* table = (const u64*)*(u64*)params[0];
    launch_params[0] = (u64)table; launch_params[1] = n;
    for (u64 c = 0; c < n; c++) memcpy((void*)table[c], (const void*)table[n + c], table[2 * n + c]);
    return 0;
}
"""


def test_the_typed_ctypes_calls_pass_what_the_driver_reads(tmp_path):
    """A C library with the driver's signatures (cuda.h's, CUDA 12) and no batch call: the copier's real
    ctypes marshalling (argtypes from ``_typed``) must hand it the PTX, the table and kernelParams intact."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "driver.c").write_text(C_DRIVER)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libdriver.so"),
                    str(tmp_path / "driver.c")], check=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "libdriver.so"))
    copier = BatchCopier(0, lib=copies._typed(lib))
    assert copier.method == "kernel"
    rng = np.random.default_rng(5)
    source, target = rng.integers(0, 256, 1 << 20, dtype=np.uint8), np.zeros(2 << 20, np.uint8)
    (dsts, srcs, sizes), expected = random_spans(rng, source, target, 25, 80 << 10)
    event = copier.submit(dsts, srcs, sizes)
    assert event.done() and np.array_equal(target, expected)
    num_chunks = reference_chunks(dsts, srcs, sizes, spancopy.CHUNK_BYTES).shape[1]
    assert list((ctypes.c_uint * 7).in_dll(lib, "launch_geometry")) == [num_chunks, 1, 1, 256, 1, 1, 0]
    params = list((ctypes.c_uint64 * 2).in_dll(lib, "launch_params"))
    assert params == [copier._kernel._table.value, num_chunks] and ctypes.c_int.in_dll(lib, "extra_is_null").value
    assert ctypes.c_uint64.in_dll(lib, "image_bytes").value == len(PTX.encode())
    assert (ctypes.c_char * 64).in_dll(lib, "function_name").value == spancopy.KERNEL_NAME
    event.release()
    copier.close()
