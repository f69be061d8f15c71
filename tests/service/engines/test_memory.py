"""Mapping an engine's shared memory: the daemon sees the engine's bytes, errors name the field, and a
registered region's pages are faulted in at once."""

import mmap
import os
from multiprocessing import shared_memory

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError, NotFoundError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines.memory import map_shm, open_region, populate
from kvxferd.wire.names import SHM_DIR


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    yield shm
    shm.close()
    shm.unlink()


def test_mapping_shares_bytes_both_ways(segment):
    engine_view = np.ndarray((1 << 16,), dtype=np.uint8, buffer=segment.buf)
    engine_view[4096:4100] = [1, 2, 3, 4]
    region = map_shm(segment.name, 4096, 8192, "regions[0]")
    assert region.array[:4].tolist() == [1, 2, 3, 4] and region.memory.num_bytes == 8192
    region.array[10] = 99  # as a NIXL read into this memory would
    assert engine_view[4106] == 99
    del engine_view
    region.close()


def test_bad_handles_name_the_field(segment):
    with pytest.raises(NotFoundError) as err:
        map_shm("kvxferd-no-such-segment", 0, 16, "groups[0].regions[1]")
    assert err.value.field == "groups[0].regions[1].shm_name"
    with pytest.raises(InvalidArgumentError) as err:
        map_shm(segment.name, 1 << 15, 1 << 16, "r")
    assert "exceeds" in err.value.message
    for name in ("", "../etc/passwd", "a/b"):
        with pytest.raises(InvalidArgumentError):
            map_shm(name, 0, 16, "r")
    with pytest.raises(InvalidArgumentError) as err:  # a GPU handle for host memory
        open_region(pb.Region(handle=pb.MemoryHandle(cuda_ipc_handle=b"x" * 64)), 16, "DRAM", "r")
    assert err.value.field == "r.handle.cuda_ipc_handle" and "VRAM" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        open_region(pb.Region(), 16, "DRAM", "r")
    assert err.value.field == "r.handle"
    with pytest.raises(InvalidArgumentError) as err:
        open_region(pb.Region(handle=pb.MemoryHandle(cuda_vmm_fd_index=2)), 16, "VRAM", "r", fds=[5])
    assert "2 fds" not in err.value.message and err.value.field == "r.handle.cuda_vmm_fd_index"


BAD_SHM_NAMES = ["/", "//", "../", "/..", "a" * 300, "a\0b", ".", "/a/b", "a\nb", ""]


@pytest.mark.parametrize("name", BAD_SHM_NAMES)
def test_bad_shm_names_are_invalid_arguments_naming_the_field(name):
    """Issue 14, defect 1: these answered INTERNAL (IsADirectoryError, name too long, embedded null byte)."""
    with pytest.raises(InvalidArgumentError) as err:
        map_shm(name, 0, 16, "engine.groups[0].regions[0]")
    assert err.value.field == "engine.groups[0].regions[0].shm_name"
    assert "/dev/shm" not in err.value.message  # never the server's paths


def test_symlinks_and_non_files_in_dev_shm_are_refused(segment, tmp_path):
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 4096)
    link = SHM_DIR / f"kvxferd-test-link-{os.getpid()}"
    directory = SHM_DIR / f"kvxferd-test-dir-{os.getpid()}"
    os.symlink(outside, link)
    os.mkdir(directory)
    try:
        for path in (link, directory):
            with pytest.raises(InvalidArgumentError) as err:
                map_shm(path.name, 0, 16, "r")
            assert err.value.field == "r.shm_name"
    finally:
        os.unlink(link)
        os.rmdir(directory)
    map_shm("/" + segment.name.lstrip("/"), 0, 16, "r").close()  # the POSIX "/name" form still works


def test_a_passed_fd_maps_the_engines_bytes_and_bad_fds_name_the_field(tmp_path):
    fd = os.memfd_create("kvxferd-test")  # what torch's shared storages and memfd engines hand over
    try:
        os.ftruncate(fd, 1 << 14)
        os.pwrite(fd, b"\x07" * 16, 4096)
        region = open_region(pb.Region(handle=pb.MemoryHandle(shm_fd_index=1, offset=4096)), 64, "DRAM", "g.r",
                             fds=[-1, fd])
        assert region.array[:16].tolist() == [7] * 16
        region.array[20] = 9
        assert os.pread(fd, 1, 4116) == b"\x09"
        region.close()
        with pytest.raises(InvalidArgumentError) as err:
            open_region(pb.Region(handle=pb.MemoryHandle(shm_fd_index=2)), 64, "DRAM", "g.r", fds=[fd])
        assert err.value.field == "g.r.handle.shm_fd_index"
        with pytest.raises(InvalidArgumentError) as err:
            open_region(pb.Region(handle=pb.MemoryHandle(shm_fd_index=0, offset=1 << 14)), 64, "DRAM", "g.r", fds=[fd])
        assert "exceeds" in err.value.message
    finally:
        os.close(fd)
    with open(tmp_path / "ro", "wb") as f:
        f.write(b"x" * 4096)
    read_only = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(InvalidArgumentError) as err:
            open_region(pb.Region(handle=pb.MemoryHandle(shm_fd_index=0)), 64, "DRAM", "g.r", fds=[read_only])
        assert err.value.field == "g.r.handle.shm_fd_index" and "read-write" in err.value.message
    finally:
        os.close(read_only)


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that contains ``address`` (its pages in our page tables)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


def test_populate_faults_in_every_page_of_the_registered_region_only():
    """The engine wrote its whole cache; the daemon's fresh mapping has none of its pages until populated,
    and then every page of the region (not of the rest of the segment)."""
    shm = shared_memory.SharedMemory(create=True, size=64 * mmap.PAGESIZE)
    try:
        np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)[:] = 7
        region = map_shm(shm.name, 8 * mmap.PAGESIZE, 32 * mmap.PAGESIZE, "regions[0]")
        address = region.array.ctypes.data
        assert _resident_bytes(address) == 0
        assert populate([region, object()]) == 32 * mmap.PAGESIZE  # other kinds of region are skipped
        assert _resident_bytes(address) == 32 * mmap.PAGESIZE
        assert region.array[::4096].tolist() == [7] * 32
        region.close()
    finally:
        shm.close()
        shm.unlink()


def test_a_passed_fd_is_kept_once_for_same_host_readers_and_closed_with_the_registration():
    """Issue #37: with same-host reads on, the daemon keeps one copy per fd the engine passed (regions of one
    fd share it) and names it in the region's share; closing the copies closes every one, even when one
    close fails; without ``kept`` (same-host reads off) nothing is kept and the region names nothing."""
    import os

    from kvxferd.service.engines.memory import KeptFds, map_fd

    fd = os.memfd_create("kvxferd-kept")
    os.ftruncate(fd, 1 << 16)
    kept = KeptFds()
    try:
        first = map_fd(fd, 0, 4096, "r", kept)
        second = map_fd(fd, 4096, 4096, "r", kept)
        copy = first.share.holder_fd
        assert copy != fd and second.share.holder_fd == copy and len(kept.copies) == 1
        assert (first.share.holder_pid, first.share.name, second.share.offset) == (os.getpid(), "", 4096)
        status = os.fstat(fd)
        assert (first.share.device, first.share.inode) == (status.st_dev, status.st_ino)
        assert map_fd(fd, 0, 4096, "r").share is None  # same-host reads off: nothing kept, nothing named
        kept.copies[-5] = (1 << 20) - 1  # a copy that fails to close does not keep the others open
        kept.close()
        with pytest.raises(OSError):
            os.fstat(copy)
        assert not kept.copies
        for region in (first, second):
            region.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("said", [True, False])
def test_a_vmm_regions_kind_takes_the_engines_word(monkeypatch, said):
    """An imported VMM handle shows no flags (H200, driver 580): the daemon passes MemoryHandle.rdma_capable on."""
    from kvxferd.service.engines import gpu

    seen = {}

    def import_vmm(fd, offset, num_bytes, device_id, field, **kwargs):
        os.close(fd)
        seen.update(kwargs)
        return gpu.GpuMapping(gpu.RegionMemory(1 << 20, num_bytes, device_id), None)

    monkeypatch.setattr(gpu, "import_vmm", import_vmm)
    monkeypatch.setattr(gpu, "uuid_of", lambda device_id, field: "")
    read_end, write_end = os.pipe()
    try:
        region = pb.Region(handle=pb.MemoryHandle(cuda_vmm_fd_index=0, allocation_bytes=1 << 21, rdma_capable=said),
                           num_bytes=16)
        mapping = open_region(region, 16, "VRAM", "r", fds=[read_end])
    finally:
        os.close(read_end)
        os.close(write_end)
    assert seen == {"allocation_bytes": 1 << 21, "rdma_capable": said} and mapping.memory.num_bytes == 16
