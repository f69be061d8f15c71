"""Every span of a batch of device copies in ONE kernel launch (issue #37): the span-copy kernel.

``cuMemcpyBatchAsync`` costs the host ~4.7 us per span (measured on an H100, driver 580): 8192 spans of
64 KiB took 38 ms (14 GB/s). Here the host only builds a table, in numpy without a loop per span, and the
GPU does the rest in one launch::

    spans ─► chunk_spans: chunks of <= CHUNK_BYTES ─► table (3 x num_chunks uint64: dsts, srcs, sizes)
    cuMemcpyHtoDAsync(table ─► the kernel's table buffer) ─► cuLaunchKernel(kvx_span_copy, table, num_chunks)

all on the copier's stream. Chunking bounds the work of one block, so a single 512 MiB span still spreads
over every SM (8192 chunks). CHUNK_BYTES is a multiple of 16: a chunk is as aligned as its span, and the
kernel's threads copy 16-byte words wherever both addresses are 16-aligned (:func:`word_bytes`).

The kernel is PTX (:mod:`kvxferd.cuda.spancopy_ptx`, from ``spancopy.cu``), which the driver JIT-compiles
for the GPU at hand when :class:`SpanKernel` loads it.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvxferd.cuda.driver import check_drv
from kvxferd.cuda.spancopy_ptx import PTX

CHUNK_BYTES = 64 << 10  # the most one block copies in one go
THREADS_PER_BLOCK = 256  # spancopy.cu's __launch_bounds__: launches must not use more
MAX_BLOCKS = 65535  # blocks stride over the chunks beyond this many
MIN_TABLE_CHUNKS = 16384  # the table buffer made at start: 384 KiB, enough for 1 GiB in full chunks
KERNEL_NAME = b"kvx_span_copy"
TABLE_ROWS = 3  # destinations, sources, sizes
_WORD = 8  # bytes of one table entry (uint64)


def chunk_spans(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """The kernel's table: spans cut into consecutive chunks of ``chunk_bytes`` (the last one of a span
    shorter), in span order, as a C-contiguous ``(3, num_chunks)`` uint64 array of destinations, sources
    and sizes. Empty spans give no chunk. ``chunk_bytes`` must be a positive multiple of 16, so that every
    chunk starts as aligned as its span."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, not {chunk_bytes}")
    dsts, srcs, sizes = (np.asarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
    step = np.uint64(chunk_bytes)
    num_chunks = ((sizes + (step - np.uint64(1))) // step).astype(np.int64)  # per span; 0 for an empty span
    if not len(sizes) or num_chunks.max() <= 1:  # the common case: each span fits one chunk
        kept = sizes > 0
        return np.ascontiguousarray(np.stack([dsts[kept], srcs[kept], sizes[kept]]))
    span = np.repeat(np.arange(len(sizes)), num_chunks)  # the span of each chunk
    first = np.cumsum(num_chunks) - num_chunks  # the index of each span's first chunk
    offsets = (np.arange(len(span)) - first[span]).astype(np.uint64) * step  # of each chunk in its span
    table = np.empty((TABLE_ROWS, len(span)), np.uint64)
    table[0] = dsts[span] + offsets
    table[1] = srcs[span] + offsets
    table[2] = np.minimum(sizes[span] - offsets, step)
    return table


def word_bytes(dsts: np.ndarray, srcs: np.ndarray) -> np.ndarray:
    """The word size the kernel copies each chunk with (16, 8, 4, else 1 byte): the widest that divides
    both addresses; the size's remainder goes byte by byte. Mirrors ``kvx_span_copy``'s choice (for tests
    and measurements: the kernel decides for itself, so a wrong table cannot make a misaligned access)."""
    both = (np.asarray(dsts, dtype=np.uint64) | np.asarray(srcs, dtype=np.uint64)) & np.uint64(15)
    return np.select([both == 0, both % 8 == 0, both % 4 == 0], [16, 8, 4], 1)


def has_kernel_calls(lib) -> bool:
    """Whether ``lib`` has the driver calls :class:`SpanKernel` needs (every CUDA 12 driver does)."""
    return all(hasattr(lib, name) for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload",
                                               "cuLaunchKernel", "cuMemcpyHtoDAsync_v2"))


def type_kernel_calls(lib: ctypes.CDLL) -> None:
    """Declare the argument types of :class:`SpanKernel`'s driver calls (as in CUDA 12's ``cuda.h``)."""
    vp, ptr, uint = ctypes.c_void_p, ctypes.POINTER, ctypes.c_uint
    lib.cuModuleLoadData.argtypes = [ptr(vp), ctypes.c_char_p]  # a NUL-terminated PTX image
    lib.cuModuleGetFunction.argtypes = [ptr(vp), vp, ctypes.c_char_p]
    lib.cuModuleUnload.argtypes = [vp]
    # f, grid x/y/z, block x/y/z, shared memory bytes, stream, kernelParams (void**), extra (void**)
    lib.cuLaunchKernel.argtypes = [vp, uint, uint, uint, uint, uint, uint, uint, vp, ptr(vp), ptr(vp)]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t, vp]


class SpanKernel:
    """The span-copy kernel loaded into the current context, with its table buffer, for one stream.

    Raises (as :func:`check_drv` does) when the driver cannot load the module: the copier then falls back
    to ``cuMemcpyBatchAsync``. Its context must be current for every call, as the copier makes it.
    """

    def __init__(self, lib, stream: ctypes.c_void_p, field: str = "same_host") -> None:
        self._lib = lib
        self._stream = stream
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
        self._table = ctypes.c_uint64(0)  # device buffer of the chunk table, for one launch at a time
        self.table_chunks = 0  # how many chunks it holds
        check_drv(lib.cuModuleLoadData(ctypes.byref(self._module), PTX.encode()), "cuModuleLoadData", field)
        try:
            check_drv(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module, KERNEL_NAME),
                      "cuModuleGetFunction", field)
            check_drv(self._grow(MIN_TABLE_CHUNKS), "cuMemAlloc", field)
        except BaseException:
            self.close()
            raise

    def _grow(self, num_chunks: int) -> int:
        """Make the table buffer hold ``num_chunks``: the driver's code, 0 when it does."""
        if num_chunks <= self.table_chunks:
            return 0
        if self._table.value:
            # A launch already on the stream may still read the old buffer: let it end first (rare, as
            # the buffer doubles at least).
            self._lib.cuStreamSynchronize(self._stream)
            self._lib.cuMemFree_v2(self._table)
            self._table, self.table_chunks = ctypes.c_uint64(0), 0
        num_chunks = max(num_chunks, 2 * self.table_chunks, MIN_TABLE_CHUNKS)
        code = self._lib.cuMemAlloc_v2(ctypes.byref(self._table), TABLE_ROWS * _WORD * num_chunks)
        if code == 0:
            self.table_chunks = num_chunks
        return code

    def launch(self, table: np.ndarray) -> str:
        """Upload ``table`` (:func:`chunk_spans`'s) and launch the kernel on the stream: "" when both are
        enqueued, else what the driver refused (the copier raises ``BatchRefused`` with it).

        The one table buffer serves every launch: the next batch's upload is enqueued on the same stream
        after this launch, so the stream runs it only once this kernel ended, and this kernel reads the
        table only after its own upload. ``table`` is pageable host memory: the driver stages it before the
        upload returns, and the caller keeps it alive until the batch ends all the same (``CopyEvent``).
        """
        num_chunks = table.shape[1]
        if (code := self._grow(num_chunks)) != 0:
            return f"cannot allocate the kernel's table of {num_chunks} chunks (CUresult {code})"
        lib = self._lib
        code = lib.cuMemcpyHtoDAsync_v2(self._table.value, table.ctypes.data, table.nbytes, self._stream)
        if code != 0:
            return f"cuMemcpyHtoDAsync refused the kernel's table (CUresult {code})"
        # kernelParams: one pointer per kernel parameter, to a value laid out as the PTX declares it
        # (.param .u64 table, .param .u64 num_chunks); the driver copies them before cuLaunchKernel returns.
        table_arg, count_arg = ctypes.c_uint64(self._table.value), ctypes.c_uint64(num_chunks)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(table_arg), ctypes.addressof(count_arg))
        num_blocks = min(num_chunks, MAX_BLOCKS)
        code = lib.cuLaunchKernel(self._function, num_blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, self._stream,
                                  params, None)
        if code != 0:
            return f"cuLaunchKernel refused the span copy of {num_chunks} chunks (CUresult {code})"
        return ""

    def close(self) -> None:
        """Free the table buffer and unload the module; the stream must have ended its launches."""
        if self._table.value:
            self._lib.cuMemFree_v2(self._table)
            self._table, self.table_chunks = ctypes.c_uint64(0), 0
        if self._module.value:
            self._lib.cuModuleUnload(self._module)
            self._module = ctypes.c_void_p()
