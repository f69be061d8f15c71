"""Same-host reads (issue #37): what a reader maps, what it refuses, and that a refusal means NIXL, not a fault."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from kvxferd.errors import TransferError
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.samehost.hostmaps import map_host_source
from kvxferd.xfer.handles import ReadFailure

GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(*GROUPS, 2, 1, name="hostmaps", same_host=True) as cluster:
        yield cluster


def _request(request_id: str, seed: int):
    return random_request(request_id, *GROUPS, 48, np.random.default_rng(seed))


def _with_share(cache, **changes):
    """``cache`` with every region's share changed as given."""
    memory = tuple(tuple(dataclasses.replace(r, share=dataclasses.replace(r.share, **changes)) for r in regions)
                   for regions in cache.memory)
    return dataclasses.replace(cache, memory=memory)


def test_a_remote_span_is_found_in_the_mapping_and_one_outside_every_region_is_refused(cluster):
    cache = cluster.prefill[0].cache
    source = map_host_source(cache)
    try:
        region = cache.memory[0][0]
        local = source.translate(np.array([region.address, region.address + region.num_bytes - 8]), np.array([8, 8]))
        arena = cluster.prefill[0].arena
        offset = region.address - arena.ctypes.data
        mapped = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 8).from_address(int(local[0])))
        assert np.array_equal(mapped, arena[offset:offset + 8])  # the same bytes, through the reader's own mapping
        for address, length in ((region.address - 1, 8), (region.address + region.num_bytes - 4, 8), (8, 8)):
            with pytest.raises(TransferError, match="outside the holder's regions"):
                source.translate(np.array([address]), np.array([length]))
    finally:
        source.close()


@pytest.mark.parametrize("change, error", [
    ({"inode": 1}, "not the one the holder mapped"),  # the name now means another object
    ({"name": "kvxferd-no-such-object"}, "cannot open"),  # another IPC namespace, or gone
    ({"offset": 1 << 40}, "exceeds the memory the holder named"),  # a region announced beyond the object
    ({"device": 1}, "not the one the holder mapped"),
])
def test_an_object_that_is_not_the_holders_region_is_not_mapped(cluster, change, error):
    with pytest.raises(TransferError, match=error):
        map_host_source(_with_share(cluster.prefill[0].cache, **change))


def test_a_region_without_a_named_object_is_read_over_nixl_byte_exact(cluster):
    """A holder that names no object (its engine passed an fd), or one the reader cannot map: NIXL reads it,
    and says why in host_errors; the read is as exact as ever."""
    executor = cluster.executors[0]
    good = cluster.prefill[0].cache
    unnamed = dataclasses.replace(good, memory=tuple(tuple(dataclasses.replace(r, share=None) for r in regions)
                                                     for regions in good.memory))
    caches = [unnamed] + [engine.cache for engine in cluster.prefill[1:]]
    metadata = [agent.metadata() for agent in cluster.prefill_agents]
    executor.connect(caches, metadata, [holder.board for holder in cluster.holders], same_host=True)
    try:
        remote = executor.remote(cluster.prefill_id)
        assert set(remote.host_ranks) == {1} and "shared-memory object it names" in remote.host_errors[0]
        request = _request("mixed", 3)
        cluster.reset_decode()
        before = executor.num_host_copies
        (result,) = cluster.read(request)
        assert result.ok and cluster.check(request) == []
        assert executor.num_host_copies == before + 1  # rank 1 copied, rank 0 over NIXL
    finally:
        cluster.connect()


def test_a_mapping_gone_under_a_read_fails_that_rank_with_its_blocks_invalid(cluster):
    """The kernel refuses the copy (EFAULT): the read fails as a transfer, the daemon lives on."""
    cluster.connect()
    remote = cluster.executors[0].remote(cluster.prefill_id)
    for host_rank in remote.host_ranks.values():
        assert host_rank.board is not None  # the holder's board is mapped too (boards.py)
        host_rank.board = None  # its checks over NIXL: this test is about the copy
        host_rank.source.close()
    request = _request("unmapped", 4)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert not result.ok and result.failure is ReadFailure.TRANSFER and "same-host copy" in result.error
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)
    cluster.connect()  # a fresh connection maps again
    cluster.reset_decode()
    (result,) = cluster.read(_request("again", 5))
    assert result.ok


def test_a_plan_too_large_to_expand_is_looked_up_per_read_as_exactly(cluster, monkeypatch):
    """Above EXPAND_MAX_DESCRIPTORS the tables are not expanded at connect: spans found per read (RowIndex)."""
    from kvxferd.xfer.samehost import hostmaps
    monkeypatch.setattr(hostmaps, "EXPAND_MAX_DESCRIPTORS", 0)
    cluster.connect()
    try:
        remote = cluster.executors[0].remote(cluster.prefill_id)
        assert remote.host_ranks and all(rank.tables is None for rank in remote.host_ranks.values())
        request = _request("looked-up", 6)
        cluster.reset_decode()
        (result,) = cluster.read(request)
        assert result.ok and cluster.check(request) == []
    finally:
        monkeypatch.undo()
        cluster.connect()
    assert all(rank.tables is not None for rank in cluster.executors[0].remote(cluster.prefill_id).host_ranks.values())


def test_a_region_whose_addresses_would_wrap_is_refused(cluster):
    cache = cluster.prefill[0].cache
    memory = ((dataclasses.replace(cache.memory[0][0], address=2**63 - 4096),) + cache.memory[0][1:],) + cache.memory[1:]
    with pytest.raises(TransferError, match="not an address range"):
        map_host_source(dataclasses.replace(cache, memory=memory))


def test_released_host_memory_is_read_over_nixl_until_connected_again(cluster):
    """A holder that changed or went away: the reader unmaps its memory (not keeping a dead engine's cache
    alive); reads still in the plan go over NIXL, as exact; a new connection maps again."""
    cluster.connect()
    executor = cluster.executors[0]
    remote = executor.remote(cluster.prefill_id)
    sources = [rank.source for rank in remote.host_ranks.values()]
    executor.release_host_memory(remote, "the holder changed")
    assert not remote.host_ranks and set(remote.host_errors.values()) == {"the holder changed"}
    assert all(source.closed for source in sources)
    before = executor.num_host_copies
    request = _request("released", 7)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == [] and executor.num_host_copies == before
    cluster.connect()
    assert len(executor.remote(cluster.prefill_id).host_ranks) == 2


def test_a_name_that_is_a_symlink_or_regions_that_overlap_are_not_mapped(cluster, tmp_path):
    """O_NOFOLLOW: a link in the directory does not lead the reader to another file; regions announced on
    top of each other are refused (the holder registered them apart)."""
    cache = cluster.prefill[0].cache
    share = cache.memory[0][0].share
    (tmp_path / share.name.lstrip("/")).symlink_to(f"/dev/shm/{share.name.lstrip('/')}")
    with pytest.raises(TransferError, match="cannot open"):
        map_host_source(cache, shm_dir=str(tmp_path))
    first, second = cache.memory[0][0], cache.memory[0][1]
    overlapping = dataclasses.replace(second, address=first.address + 8)
    memory = ((first, overlapping) + cache.memory[0][2:],) + cache.memory[1:]
    with pytest.raises(TransferError, match="overlap"):
        map_host_source(dataclasses.replace(cache, memory=memory))


def test_an_object_the_engine_passed_as_an_fd_is_mapped_through_the_holders_copy_and_checked(
        cluster, tmp_path, monkeypatch):
    """An engine that passed its memory as an fd names no object: the holder keeps a copy of the fd and the
    reader opens /proc/<holder pid>/fd/<copy> (same user, same PID namespace), checked before it is opened
    for reading: another shared-memory object, a file on disk, a FIFO (whose open would block), no such
    fd, or another user's process are refused."""
    import os
    import time

    cache = cluster.prefill[0].cache
    name = cache.memory[0][0].share.name.lstrip("/")
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    other = os.memfd_create("kvxferd-other")  # shared memory too, but not the holder's object
    os.ftruncate(other, 1 << 20)
    on_disk = os.open(pathlib.Path(__file__), os.O_RDONLY)  # the source tree: not tmpfs
    os.mkfifo(tmp_path / "fifo")
    fifo = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)

    def passed(copy: int, pid: int = os.getpid(), of: int | None = None):
        """``cache`` as a holder names it when its engine passed an fd; ``of``: announce that fd's identity."""
        changes = dict(name="", holder_pid=pid, holder_fd=copy)
        if of is not None:
            status = os.fstat(of)
            changes.update(device=status.st_dev, inode=status.st_ino)
        return _with_share(cache, **changes)

    try:
        source = map_host_source(passed(fd))
        try:
            region = cache.memory[0][0]
            (local,) = source.translate(np.array([region.address]), np.array([64]))
            arena = cluster.prefill[0].arena
            offset = region.address - arena.ctypes.data
            mapped = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 64).from_address(int(local)))
            assert np.array_equal(mapped, arena[offset:offset + 64])
        finally:
            source.close()
        with pytest.raises(TransferError, match="not the one the holder mapped"):
            map_host_source(passed(other))
        for refused in (on_disk, fifo):  # announced with their own identity: refused for what they are
            start = time.monotonic()
            with pytest.raises(TransferError, match="not a shared-memory object"):
                map_host_source(passed(refused, of=refused))
            assert time.monotonic() - start < 1.0
        with pytest.raises(TransferError, match="cannot open"):
            map_host_source(passed((1 << 20) - 1))
        with pytest.raises(TransferError, match="not one of this user's"):  # no such process
            map_host_source(passed(fd, pid=(1 << 22) - 1))
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # the holder's process is another user's
        with pytest.raises(TransferError, match="not one of this user's"):
            map_host_source(passed(fd))
    finally:
        monkeypatch.undo()
        for opened in (fd, other, on_disk, fifo):
            os.close(opened)


def test_objects_passed_by_fd_can_be_opened_by_another_process_and_are_checked_the_same(cluster):
    """For a sandboxed reader worker (issue #55) its daemon opens each object passed by fd
    (``open_passed_objects``: the fd, or why not) and the worker maps from those: a reason is the rank's
    error, an fd of another object is refused as if opened here, and named objects are not touched. What
    travels to the worker (``message``/``of_message``) comes back as sent; malformed, it is refused."""
    import os

    from kvxferd.errors import InvalidArgumentError
    from kvxferd.xfer.samehost.opened import OpenedObjects, open_passed_objects

    cache = cluster.prefill[0].cache
    name = cache.memory[0][0].share.name.lstrip("/")
    fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    share = cache.memory[0][0].share
    identity = (share.device, share.inode)
    passed = _with_share(cache, name="", holder_pid=os.getpid(), holder_fd=fd)
    gone = _with_share(cache, name="", holder_pid=os.getpid(), holder_fd=(1 << 20) - 1, inode=share.inode + 1)
    other = os.memfd_create("kvxferd-other")
    os.ftruncate(other, 1 << 20)
    try:
        assert open_passed_objects([cache]) == OpenedObjects()  # by name: the worker opens those itself
        opened = open_passed_objects([passed, gone])
        try:
            assert set(opened.objects) == {identity, (share.device, share.inode + 1)}
            assert isinstance(opened.objects[identity], int)
            assert "cannot open" in opened.objects[(share.device, share.inode + 1)]
            map_host_source(passed, opened=opened).close()
            with pytest.raises(TransferError, match="cannot open"):
                map_host_source(gone, opened=opened)
            with pytest.raises(TransferError, match="did not open it"):
                map_host_source(passed, opened=OpenedObjects())
            with pytest.raises(TransferError, match="not the one the holder mapped"):
                map_host_source(passed, opened=OpenedObjects({identity: other}))
            from kvxferd.xfer.samehost.opened import holder_pidfd
            opened.pidfds[os.getpid()] = holder_pidfd(os.getpid())
            opened.pidfds[1 << 22] = "gone"
            message, fds = opened.message()
            assert fds[0] == opened.pidfds[os.getpid()]  # pidfds first: few, and each board needs its holder's
            assert OpenedObjects.of_message(message, fds) == opened and OpenedObjects.of_message(None, []) is None
            for bad in ({"objects": [[1, 2, 5]]}, {"objects": [[1, 2]]}, {"objects": [["1", 2, 0]]}, "x",
                        {"pidfds": [[1, -1]]}, {"pidfds": [[True, 0]]}):
                with pytest.raises(InvalidArgumentError):
                    OpenedObjects.of_message(bad, fds)
        finally:
            opened.close()
    finally:
        os.close(fd)
        os.close(other)
