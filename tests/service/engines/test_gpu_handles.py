"""GPU handles: clear errors without a GPU; fds pass to the daemon over the fd socket."""

import ctypes
import os

import pytest

from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.service.engines import gpu
from kvxferd.client.fdsend import send_fds
from kvxferd.service.engines.fdpass import FdInbox

NO_GPU = not os.path.exists("/dev/nvidia0")


def test_ipc_handle_is_checked_before_cuda_is_touched():
    with pytest.raises(InvalidArgumentError) as err:
        gpu.open_ipc(b"short", 0, 16, 0, "groups[0].regions[0]")
    assert err.value.field == "groups[0].regions[0].handle.cuda_ipc_handle"
    with pytest.raises(InvalidArgumentError):
        gpu.open_ipc(b"\0" * 64, -1, 16, 0, "r")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: tests/gpu/ covers it")
def test_without_a_gpu_both_kinds_fail_as_unavailable():
    with pytest.raises(UnavailableError) as err:
        gpu.open_ipc(b"\0" * 64, 0, 16, 0, "r")
    assert err.value.field.startswith("r.")
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(UnavailableError):
        gpu.import_vmm(read_end, 0, 16, 0, "r")
    with pytest.raises(OSError):
        os.fstat(read_end)  # the fd was consumed either way


def test_fds_travel_with_a_token(tmp_path):
    inbox = FdInbox(str(tmp_path / "e.sock.fds"))
    try:
        read_end, write_end = os.pipe()
        send_fds(inbox.path, "tok", [write_end])
        (received,) = inbox.take("tok")
        os.write(received, b"hi")  # the daemon's copy writes into the engine's pipe
        assert os.read(read_end, 2) == b"hi"
        for fd in (received, read_end, write_end):
            os.close(fd)
        with pytest.raises(InvalidArgumentError):
            inbox.take("tok")
    finally:
        inbox.close()


def test_ipc_handle_forms_without_a_gpu():
    bare = bytes(range(1, 9)) + b"\0" * 8 + bytes(range(200, 248))  # NULs inside: must survive
    assert gpu._bare_ipc_handle(bare, "r") == bare
    assert ctypes.string_at(ctypes.addressof(gpu.IpcHandle.from_buffer_copy(bare)), 64) == bare
    assert gpu._bare_ipc_handle(b"\x02c" + bare, "r") == bare  # torch's _share_cuda_() form
    with pytest.raises(InvalidArgumentError, match="expandable"):
        gpu._bare_ipc_handle(b"\x02e" + bare, "r")
    with pytest.raises(InvalidArgumentError, match="65 bytes"):
        gpu._bare_ipc_handle(b"x" + bare, "r")


def test_the_engines_gpu_is_found_by_uuid_not_by_index():
    """The daemon may see the engine's GPU under another index (its own CUDA_VISIBLE_DEVICES): the UUID decides."""
    a, b, c = (gpu.format_uuid(bytes([n]) * 16) for n in (0xAA, 0xBB, 0xCC))
    seen = lambda field: [a, b]  # noqa: E731 - this daemon's devices, by index
    assert gpu.resolve_device(0, b, "r", visible=seen) == 1
    assert gpu.resolve_device(3, "", "r", visible=seen) == 3  # no UUID (an older client): the index is trusted
    with pytest.raises(UnavailableError) as err:  # -> FAILED_PRECONDITION: not this daemon's GPU
        gpu.resolve_device(0, c, "groups[0].regions[0]", visible=seen)
    assert err.value.field == "groups[0].regions[0].device_uuid"
    assert c in err.value.message and a in err.value.message
    for bad in ("GPU-aaaa", "x" * 300, "MIG-" + a[4:], a.upper()):  # refused before any CUDA call
        with pytest.raises(InvalidArgumentError, match="not a GPU UUID"):
            gpu.resolve_device(0, bad, "r", visible=seen)
    assert gpu.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: tests/gpu/ covers it")
def test_without_a_gpu_a_uuid_cannot_be_resolved():
    with pytest.raises(UnavailableError) as err:
        gpu.resolve_device(0, gpu.format_uuid(bytes(16)), "r")
    assert err.value.field.startswith("r.device_uuid")
