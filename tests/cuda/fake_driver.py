"""The CUDA driver calls BatchCopier makes, played on host memory, for tests on machines without a GPU.

It stands in only for the driver (no GPU here); NIXL, boards and executors
stay real. Asynchrony is played too: a batch's copies wait on the stream
and happen only when its event is queried ``lag`` times, synchronized, or
the stream is: a reader that used the bytes before the event said done
would see the old ones.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from kvxferd.cuda.copies import CUDA_ERROR_NOT_READY


class FakeDriver:
    """Records every call; ``batch_code``/``failed_copy`` refuse batches, ``event_code`` fails an event,
    ``corrupt`` leaves out the last 8 bytes of every span (a wrong copy the oracle must catch)."""

    def __init__(self, lag: int = 2) -> None:
        self.lag = lag
        self.paused = False  # True: every event query answers NOT_READY (and counts nothing down)
        self.calls: list[str] = []
        self._thread = threading.local()  # CUDA's current context is per thread
        self.pending: list[tuple[int, list[tuple[int, int, int]]]] = []  # (event, copies) in stream order
        self.events: dict[int, int] = {}  # event -> queries left until done
        self.batch_sizes: list[int] = []
        self.attributes = []
        self.batch_code = 0
        self.failed_copy = None
        self.event_code = 0
        self.corrupt = False
        self._next = 100
        self.scratch: list[np.ndarray] = []
        self.destroyed: set[int] = set()

    @property
    def current(self):
        """The context made current on the calling thread (None: none was)."""
        return getattr(self._thread, "context", None)

    def _handle(self) -> int:
        self._next += 1
        return self._next

    def _record(self, name: str) -> None:
        self.calls.append(name)

    # ---- set-up -----------------------------------------------------------------
    def cuInit(self, flags):
        self._record("cuInit")
        return 0

    def cuDeviceGet(self, device, index):
        device._obj.value = index
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):
        context._obj.value = 7000 + device.value
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device):
        self._record("cuDevicePrimaryCtxRelease")
        return 0

    def cuMemAlloc_v2(self, pointer, num_bytes):
        buffer = np.zeros(num_bytes, np.uint8)
        self.scratch.append(buffer)  # host memory standing in for the device's
        pointer._obj.value = buffer.ctypes.data
        return 0

    def cuMemFree_v2(self, pointer):
        self._record("cuMemFree")
        return 0

    def cuCtxSetCurrent(self, context):
        self._thread.context = context.value
        return 0

    def cuStreamCreate(self, stream, flags):
        assert flags == 1  # non-blocking: never the legacy NULL stream's implicit waits
        stream._obj.value = self._handle()
        return 0

    # ---- copies -----------------------------------------------------------------
    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attributes, attribute_indices, num_attributes, failed,
                           stream):
        self._record("cuMemcpyBatchAsync")
        assert self.current is not None, "no context current on this thread"
        self.attributes.append((attributes._obj.src_access_order, attribute_indices._obj.value, num_attributes))
        if self.batch_code:
            if self.failed_copy is not None:
                failed._obj.value = self.failed_copy
            return self.batch_code
        arrays = [np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(p)).copy() for p in (dsts, srcs, sizes)]
        self.batch_sizes.append(count)
        self.pending.append((None, list(zip(*(a.tolist() for a in arrays)))))
        return 0

    def cuEventCreate(self, event, flags):
        event._obj.value = self._handle()
        return 0

    def cuEventRecord(self, event, stream):
        self._record("cuEventRecord")
        self.events[event.value] = self.lag
        # the copies enqueued since the last event end with this one
        self.pending = [(event.value if e is None else e, copies) for e, copies in self.pending]
        return 0

    def cuEventQuery(self, event):
        self._record("cuEventQuery")
        assert self.current is not None, "no context current on this thread"
        if self.event_code:
            return self.event_code
        if self.paused:  # a test that must see copies in flight: none ends, however often it is asked
            return CUDA_ERROR_NOT_READY
        if self.events[event.value] > 0:
            self.events[event.value] -= 1
            return CUDA_ERROR_NOT_READY
        self._run(event.value)
        return 0

    def cuEventSynchronize(self, event):
        self._record("cuEventSynchronize")
        assert self.current is not None, "no context current on this thread"
        self._run(event.value)
        return self.event_code

    def cuEventDestroy_v2(self, event):
        self.destroyed.add(event.value)
        return 0

    def cuStreamSynchronize(self, stream):
        self._record("cuStreamSynchronize")
        assert self.current is not None, "no context current on this thread"
        for event, _ in list(self.pending):
            self._run(event)
        return 0

    def cuStreamDestroy_v2(self, stream):
        self._record("cuStreamDestroy")
        return 0

    def _run(self, event: int) -> None:
        """Play the copies up to and including ``event``'s, in stream order."""
        while any(e == event for e, _ in self.pending):
            done_event, copies = self.pending.pop(0)
            for dst, src, size in copies:
                ctypes.memmove(dst, src, size - 8 if self.corrupt and size > 8 else size)
            self.events[done_event] = 0
