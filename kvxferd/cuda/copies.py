"""Many device-to-device copies as one batch on a stream, done when its event is (issue #37).

A same-host read of a GPU cache is a list of spans (a few per block and
layer). One launch of the span-copy kernel (:mod:`kvxferd.cuda.spancopy`)
copies them all: the host cuts the spans into chunks of at most 64 KiB in
numpy, uploads that table on the copier's stream and launches the kernel
after it; an event recorded after the launch says when the batch ended: the
reader polls it (``cuEventQuery``) like a NIXL transfer's state, never
waiting on the device where a loop runs::

    submit(dsts, srcs, sizes) ─► chunks ─► cuMemcpyHtoDAsync, cuLaunchKernel (stream) ─► cuEventRecord
    poll: cuEventQuery(event)   NOT_READY ─► still running;  SUCCESS ─► done

Why not the driver's own batch call: ``cuMemcpyBatchAsync`` (CUDA 12.8 and
later) does NOT merge the copies. Measured on an H100 (driver 580, CUDA 13),
it costs ~4.7 us of host time per span inside the call, so 8192 spans of
64 KiB took 38 ms (14 GB/s) and 64 spans 341 us, where one gather kernel
(torch's index_copy) did them in 1.5 ms and 31 us. It stays as the fallback when the driver cannot
load the kernel's PTX; its symbol without a version suffix keeps CUDA 12.8's
signature (with ``failIdx``) in CUDA 13 drivers too. A driver with neither
raises :class:`UnavailableError` here, and the reader reads over NIXL.

Copies between two GPUs need peer access, which opening an IPC handle on the
reader's GPU with ``cudaIpcMemLazyEnablePeerAccess`` gives
(:mod:`kvxferd.cuda.ipc`): the kernel then reads the other GPU's memory
directly. :meth:`BatchCopier.check_source` copies a few bytes of each opened
allocation at connect, with the same kernel, so a path that does not copy is
found there (and read over NIXL), not in a request. Where the driver's batch
call could refuse such a path, a kernel faults on it (see below).

A device-side fault (an illegal address) poisons the context for good: the
copier then refuses every later batch (:attr:`BatchCopier.broken`), and the
reader goes back to NIXL.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from kvxferd.cuda import spancopy
from kvxferd.cuda.driver import CU_LOCATION_DEVICE, Location, check_drv, cuda
from kvxferd.errors import KvxferError, TransferError, UnavailableError

log = logging.getLogger(__name__)

CU_STREAM_NON_BLOCKING = 1
CU_EVENT_BLOCKING_SYNC = 1  # a wait for it (an aborted read's) sleeps instead of spinning a core
CU_EVENT_DISABLE_TIMING = 2
CHECK_BYTES = 64  # copied from each opened allocation at connect (check_source)
CUDA_ERROR_NOT_READY = 600
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # read the sources in stream order (after what the stream did before)
NO_FAILED_COPY = (1 << 64) - 1  # failIdx as the driver leaves it when no single copy is to blame


class BatchRefused(TransferError):
    """The driver refused a batch when it was submitted: nothing of it runs (the rank can go over NIXL)."""


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: how the copies of a batch access their operands."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", Location), ("dst_location", Location),
                ("flags", ctypes.c_uint)]


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with the calls used here typed; raises :class:`UnavailableError` when it has neither the
    span-copy kernel's calls nor the batch call."""
    vp, ptr = ctypes.c_void_p, ctypes.POINTER
    if spancopy.has_kernel_calls(lib):
        spancopy.type_kernel_calls(lib)
    elif not hasattr(lib, "cuMemcpyBatchAsync"):
        raise UnavailableError("same_host", "the CUDA driver can neither launch kernels nor batch copies "
                                            "(cuMemcpyBatchAsync needs CUDA 12.8 or later)")
    if hasattr(lib, "cuMemcpyBatchAsync"):
        lib.cuMemcpyBatchAsync.argtypes = [vp, vp, vp, ctypes.c_size_t, ptr(MemcpyAttributes), ptr(ctypes.c_size_t),
                                           ctypes.c_size_t, ptr(ctypes.c_size_t), vp]
    for name, argtypes in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [ptr(ctypes.c_int), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [ptr(vp), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]), ("cuCtxSetCurrent", [vp]),
                           ("cuMemAlloc_v2", [ptr(ctypes.c_uint64), ctypes.c_size_t]),
                           ("cuMemFree_v2", [ctypes.c_uint64]),
                           ("cuStreamCreate", [ptr(vp), ctypes.c_uint]), ("cuStreamSynchronize", [vp]),
                           ("cuStreamDestroy_v2", [vp]), ("cuEventCreate", [ptr(vp), ctypes.c_uint]),
                           ("cuEventRecord", [vp, vp]), ("cuEventQuery", [vp]), ("cuEventSynchronize", [vp]),
                           ("cuEventDestroy_v2", [vp])):
        getattr(lib, name).argtypes = argtypes
    return lib


class CopyEvent:
    """One submitted batch: :meth:`done` polls it, :meth:`release` lets go of it."""

    def __init__(self, copier: "BatchCopier", event: ctypes.c_void_p, arrays: tuple[np.ndarray, ...]) -> None:
        self._copier = copier
        self._event = event
        self._arrays = arrays  # the address lists stay alive until the batch ended
        self._done = False

    def done(self) -> bool:
        """Whether the batch ended; raises :class:`TransferError` when the device reported an error (the
        copier is broken from then on: a fault poisons the context)."""
        if not self._done and self._event is not None:
            code = self._copier.query(self._event)
            if code == CUDA_ERROR_NOT_READY:
                return False
            self._ended(code, "cuEventQuery")
        return True

    def wait(self) -> None:
        """Wait for the batch (the calling thread sleeps on the event); raises as :meth:`done`."""
        if not self._done and self._event is not None:
            self._ended(self._copier.wait(self._event), "cuEventSynchronize")

    def _ended(self, code: int, call: str) -> None:
        if code != 0:
            self._copier.broken = f"a device copy failed ({call} CUresult {code})"
            raise TransferError("same_host", self._copier.broken)
        self._done = True

    def release(self) -> None:
        """Destroy the event. A batch still running is waited for first: it writes into the reader's cache,
        whose blocks the engine may reuse once the read ended (bounded: a copy within this host)."""
        if self._event is not None:
            self._copier.end(self._event, wait=not self._done)
            self._event = None
            self._arrays = ()


class BatchCopier:
    """Copies between device addresses of this process on one non-blocking stream of GPU ``device_id``.

    Each call makes the device's primary context current on the calling
    thread first: a daemon posts from its event loop and its data-plane
    thread. Not thread-safe on its own: the read executor's lock serialises it.
    ``method`` says how batches copy: ``"kernel"`` (one span-copy launch each)
    or ``"cuMemcpyBatchAsync"`` (the driver cannot load the kernel).
    """

    def __init__(self, device_id: int, field: str = "same_host", *, lib=None) -> None:
        self._lib = lib if lib is not None else _typed(cuda(field))
        self.device_id = device_id
        self.broken = ""  # why no batch may run any more (a device fault), or ""
        lib = self._lib
        self._device, self._context, self._stream = ctypes.c_int(), ctypes.c_void_p(), None
        self._scratch = ctypes.c_uint64(0)
        self._kernel: spancopy.SpanKernel | None = None
        check_drv(lib.cuInit(0), "cuInit", field)
        check_drv(lib.cuDeviceGet(ctypes.byref(self._device), device_id), "cuDeviceGet", field)
        check_drv(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), self._device), "cuDevicePrimaryCtxRetain",
                  field)
        try:
            self._current()
            stream = ctypes.c_void_p()
            check_drv(lib.cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate", field)
            self._stream = stream
            check_drv(lib.cuMemAlloc_v2(ctypes.byref(self._scratch), CHECK_BYTES), "cuMemAlloc", field)
            self._kernel = self._load_kernel(field)
            if self._kernel is None and not hasattr(lib, "cuMemcpyBatchAsync"):
                raise UnavailableError(field, "the span-copy kernel does not load and the CUDA driver has no "
                                              "cuMemcpyBatchAsync (it needs CUDA 12.8 or later)")
        except BaseException:
            self.close()
            raise
        self.method = "kernel" if self._kernel is not None else "cuMemcpyBatchAsync"
        here = Location(CU_LOCATION_DEVICE, device_id)  # hints only (they matter for managed memory alone)
        self._attributes = MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, here, here, 0)
        self._attribute_index = ctypes.c_size_t(0)  # one attribute entry, for every copy from index 0 on

    def _load_kernel(self, field: str) -> spancopy.SpanKernel | None:
        """The span-copy kernel in this context, or None (logged) when the driver cannot load it."""
        if not spancopy.has_kernel_calls(self._lib):
            return None
        try:
            return spancopy.SpanKernel(self._lib, self._stream, field)
        except KvxferError as err:  # e.g. a driver older than the PTX's ISA: the batch call still copies
            log.warning("GPU %d: the span-copy kernel does not load (%s); device copies use cuMemcpyBatchAsync",
                        self.device_id, err.message)
            return None

    def _current(self) -> None:
        check_drv(self._lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent", "same_host")

    def submit(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> CopyEvent:
        """Enqueue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i, then an event; raises
        :class:`TransferError` when the driver refuses the batch (:class:`BatchRefused`: nothing of it
        copies then)."""
        if self._stream is None or self.broken:
            raise TransferError("same_host", self.broken or "the device copier was closed")
        arrays = tuple(np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
            raise TransferError("same_host", "destinations, sources and sizes differ in length")
        lib = self._lib
        self._current()
        if self._kernel is not None:
            table = spancopy.chunk_spans(*arrays)
            arrays += (table,)  # kept with the event: the upload reads it from the stream
            if table.shape[1] and (refused := self._kernel.launch(table)):
                lib.cuStreamSynchronize(self._stream)  # an enqueued upload ends before its table is let go
                raise BatchRefused("same_host", refused)
        elif len(arrays[2]):
            failed = ctypes.c_size_t(NO_FAILED_COPY)
            code = lib.cuMemcpyBatchAsync(*(a.ctypes.data for a in arrays), len(arrays[2]),
                                          ctypes.byref(self._attributes), ctypes.byref(self._attribute_index), 1,
                                          ctypes.byref(failed), self._stream)
            if code != 0:
                lib.cuStreamSynchronize(self._stream)  # should nothing have been refused after all: none runs on
                which = "" if failed.value == NO_FAILED_COPY else f", copy {failed.value} of {len(arrays[2])}"
                raise BatchRefused("same_host", f"cuMemcpyBatchAsync refused the batch (CUresult {code}{which})")
        event = ctypes.c_void_p()
        check = lib.cuEventCreate(ctypes.byref(event), CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING)
        if check == 0 and (check := lib.cuEventRecord(event, self._stream)) != 0:
            lib.cuEventDestroy_v2(event)
        if check != 0:  # the batch is enqueued but cannot be watched: wait for it here, rarely
            lib.cuStreamSynchronize(self._stream)
            raise TransferError("same_host", f"cannot record the copy's event (CUresult {check})")
        return CopyEvent(self, event, arrays)

    def check_source(self, address: int, num_bytes: int) -> None:
        """Copy the first bytes at ``address`` (an opened allocation) here and wait: raises
        :class:`TransferError` when the driver refuses or faults (the path is unusable: read over NIXL)."""
        event = self.submit(np.array([self._scratch.value]), np.array([address]),
                            np.array([min(CHECK_BYTES, num_bytes)]))
        try:
            event.wait()
        finally:
            event.release()

    def query(self, event: ctypes.c_void_p) -> int:
        """``cuEventQuery``'s code: 0 done, :data:`CUDA_ERROR_NOT_READY` still running, else an error."""
        self._current()
        return self._lib.cuEventQuery(event)

    def wait(self, event: ctypes.c_void_p) -> int:
        """``cuEventSynchronize``'s code: 0 once the event's batch ended, else an error."""
        self._current()
        return self._lib.cuEventSynchronize(event)

    def end(self, event: ctypes.c_void_p, *, wait: bool) -> None:
        """Destroy ``event``, after waiting for its batch when ``wait``."""
        if wait:
            self.wait(event)
        self._current()
        self._lib.cuEventDestroy_v2(event)

    def synchronize(self) -> None:
        """Wait until every batch submitted so far ended (before memory they read is closed)."""
        if self._stream is not None:
            self._current()
            self._lib.cuStreamSynchronize(self._stream)

    def close(self) -> None:
        """Wait for the stream, then destroy it and let go of the context; later submits are refused."""
        if self._context is None:
            return
        self._current()
        if self._stream is not None:
            self.synchronize()
            if self._kernel is not None:
                self._kernel.close()
                self._kernel = None
            self._lib.cuStreamDestroy_v2(self._stream)
            self._stream = None
        if self._scratch.value:
            self._lib.cuMemFree_v2(self._scratch)
            self._scratch = ctypes.c_uint64(0)
        self._lib.cuDevicePrimaryCtxRelease_v2(self._device)
        self._context = None
