"""GPU handles: clear errors without a GPU; fds pass to the daemon over the fd socket."""

import ctypes
import os

import pytest

from kvxferd.errors import InvalidArgumentError, UnavailableError
from kvxferd.cuda import ipc
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
    assert ipc.bare_ipc_handle(bare, "r") == bare
    assert ctypes.string_at(ctypes.addressof(ipc.IpcHandle.from_buffer_copy(bare)), 64) == bare
    assert ipc.bare_ipc_handle(b"\x02c" + bare, "r") == bare  # torch's _share_cuda_() form
    with pytest.raises(InvalidArgumentError, match="expandable"):
        ipc.bare_ipc_handle(b"\x02e" + bare, "r")
    with pytest.raises(InvalidArgumentError, match="65 bytes"):
        ipc.bare_ipc_handle(b"x" + bare, "r")


def test_the_engines_gpu_is_found_by_uuid_not_by_index():
    """The daemon may see the engine's GPU under another index (its own CUDA_VISIBLE_DEVICES): the UUID decides."""
    a, b, c = (ipc.format_uuid(bytes([n]) * 16) for n in (0xAA, 0xBB, 0xCC))
    seen = lambda field: [a, b]  # noqa: E731 - this daemon's devices, by index
    assert ipc.resolve_device(0, b, "r", visible=seen) == 1
    assert ipc.resolve_device(3, "", "r", visible=seen) == 3  # no UUID (an older client): the index is trusted
    with pytest.raises(UnavailableError) as err:  # -> FAILED_PRECONDITION: not this daemon's GPU
        ipc.resolve_device(0, c, "groups[0].regions[0]", visible=seen)
    assert err.value.field == "groups[0].regions[0].device_uuid"
    assert c in err.value.message and a in err.value.message
    for bad in ("GPU-aaaa", "x" * 300, "MIG-" + a[4:], a.upper()):  # refused before any CUDA call
        with pytest.raises(InvalidArgumentError, match="not a GPU UUID"):
            ipc.resolve_device(0, bad, "r", visible=seen)
    assert ipc.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: tests/gpu/ covers it")
def test_without_a_gpu_a_uuid_cannot_be_resolved():
    with pytest.raises(UnavailableError) as err:
        ipc.resolve_device(0, ipc.format_uuid(bytes(16)), "r")
    assert err.value.field.startswith("r.device_uuid")


def test_an_opened_ipc_region_remembers_its_handle_and_gpu_for_same_host_readers(monkeypatch):
    """What a proven same-host reader opens itself (issue #37): the bare handle, the offset, the GPU's UUID
    (the engine's, or the one this daemon sees at the index); no UUID to be had: nothing to share."""
    closed = []
    monkeypatch.setattr(gpu, "open_ipc_allocation",
                        lambda handle, device_id, field: ipc.IpcAllocation(1 << 30, 1 << 20, lambda: closed.append(1)))
    bare = bytes(range(64))
    seen = lambda field: [ipc.format_uuid(b"\1" * 16), ipc.format_uuid(b"\2" * 16)]  # noqa: E731
    mapping = gpu.open_ipc(b"\x02c" + bare, 4096, 8192, 1, "r", uuids=seen)
    assert mapping.memory.address == (1 << 30) + 4096
    assert mapping.memory.share == gpu.DeviceShare(bare, 4096, ipc.format_uuid(b"\2" * 16))
    named = gpu.open_ipc(bare, 0, 8192, 1, "r", "GPU-00000000-0000-0000-0000-000000000001", uuids=seen)
    assert named.memory.share.device_uuid == "GPU-00000000-0000-0000-0000-000000000001"

    def no_driver(field):
        raise UnavailableError(field, "no driver")

    assert gpu.open_ipc(bare, 0, 8192, 5, "r", uuids=no_driver).memory.share is None
    with pytest.raises(InvalidArgumentError, match="exceeds the shared allocation"):
        gpu.open_ipc(bare, 1 << 20, 1, 0, "r", uuids=seen)
    assert closed == [1]  # the refused one was closed again
