"""The CUDA runtime and driver calls both sides of a GPU cache need, through ``ctypes``.

An engine exports its cache (:mod:`kvxferd.client.gpu`) and the daemon opens
it (:mod:`kvxferd.service.engines.gpu`) with these; neither needs a CUDA build of
torch. Without a CUDA library the loaders raise :class:`UnavailableError`
naming the field.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kvxferd.errors import InvalidArgumentError, UnavailableError

IPC_HANDLE_BYTES = 64
VMM_GRANULARITY = 2 << 20  # CUDA's minimum mapping granularity on current GPUs
IPC_LAZY_ENABLE_PEER_ACCESS = 1
CU_HANDLE_TYPE_POSIX_FD = 1
CU_LOCATION_DEVICE = 1
CU_ACCESS_READWRITE = 3


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def _load(names: tuple[str, ...], what: str, field: str) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library(what)
    if found:
        return ctypes.CDLL(found)
    raise UnavailableError(field, f"GPU memory needs the CUDA {what} library, which this daemon cannot load "
                                  "(no GPU driver on this machine?)")


def cudart(field: str) -> ctypes.CDLL:
    """The CUDA runtime, with the IPC calls typed."""
    lib = _load(("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"), "cudart", field)
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def cuda(field: str) -> ctypes.CDLL:
    """The CUDA driver library."""
    return _load(("libcuda.so.1", "libcuda.so"), "cuda", field)


# Codes that mean "no usable GPU here" rather than "bad handle": initialization
# error, insufficient driver, stub library, no device, driver mismatch.
_NO_GPU_RUNTIME = {3, 34, 35, 100, 803, 804}
_NO_GPU_DRIVER = {3, 34, 100, 803, 804}


def check_rt(lib: ctypes.CDLL, code: int, call: str, field: str) -> None:
    """Raise for a runtime error: no usable GPU is UNAVAILABLE, anything else a bad argument."""
    if code != 0:
        kind = UnavailableError if code in _NO_GPU_RUNTIME else InvalidArgumentError
        raise kind(field, f"{call} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


def check_drv(code: int, call: str, field: str) -> None:
    """Raise for a driver error: no usable GPU is UNAVAILABLE, anything else a bad argument."""
    if code != 0:
        kind = UnavailableError if code in _NO_GPU_DRIVER else InvalidArgumentError
        raise kind(field, f"{call} failed with CUresult {code}")


def address_range(address: int, field: str, lib=None) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding ``address`` (``cuMemGetAddressRange``)."""
    drv = lib or cuda(field)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if isinstance(drv, ctypes.CDLL):
        drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
    check_drv(drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange", field)
    return base.value, size.value


def allocation_size(base: int, field: str) -> int:
    """The size of the allocation that starts at ``base``."""
    return address_range(base, field)[1]
