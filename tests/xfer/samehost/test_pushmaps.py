"""Same-host pushes (issue #57): what a writer maps read-write, what it refuses, and that a refusal means a NIXL
WRITE, not a fault."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from kvxferd.errors import TransferError
from kvxferd.plan.push import PushPlan, PushRequest
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.rig.verify.pushcluster import PushCluster
from kvxferd.xfer.samehost.hostmaps import map_host_source
from kvxferd.xfer.samehost.ranks import open_push_target

from tests.xfer.samehost.test_hostmaps import _with_share

GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster():
    with PushCluster(*GROUPS, 1, 1, name="pushmaps", same_host=True) as cluster:
        yield cluster


def _push(cluster, target, request, capability):
    pusher = cluster.pushers[0]
    push = PushRequest(request.remote_request_id, request.local_block_ids, request.remote_block_ids, capability,
                       request.num_tokens)
    inflight = pusher.post(target, pusher.plan(target, 0, push))
    while (result := pusher.poll(inflight)) is None:
        pass
    pusher.send_notice(inflight, 0)
    return result


def _permissions(address: int) -> str:
    """The permissions of this process's mapping that holds ``address`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, permissions = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return permissions
    raise AssertionError(f"{address:#x} is not mapped")


def test_a_target_mapped_writable_takes_the_writers_bytes_and_the_reads_mapping_stays_read_only():
    """The writable mapping is the target's object itself (a byte written through it is in the engine's
    array); the reads' mapping of the same object is read-only (the control)."""
    with PushCluster(*GROUPS, 1, 1, name="pushmaps-rw", same_host=True) as cluster:
        cache, arena = cluster.decode[0].cache, cluster.decode[0].arena
        region = cache.memory[0][0]
        offset = region.address - arena.ctypes.data
        for writable in (True, False):
            source = map_host_source(cache, writable=writable)
            try:
                (local,) = source.translate(np.array([region.address]), np.array([8]))
                assert _permissions(int(local)).startswith("rw" if writable else "r-")
                if writable:
                    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 8).from_address(int(local)))[:] = 7
                    assert (arena[offset:offset + 8] == 7).all()
            finally:
                source.close()


@pytest.mark.parametrize("change, error", [
    ({"name": "kvxferd-no-such-object"}, "cannot open"),  # another IPC namespace, or gone
    ({"inode": 1}, "not the one the holder mapped"),  # the name now means another object
])
def test_a_target_whose_memory_cannot_be_mapped_is_written_over_nixl(cluster, change, error):
    """The connection says why (``host_error``), maps nothing, and the push is still byte-exact: a WRITE."""
    pusher, decode = cluster.pushers[0], cluster.decode[0]
    try:
        target = pusher.connect(_with_share(decode.cache, **change), cluster.decode_agents[0].metadata(),
                                cluster.expectations[0].board, same_host=True)
        assert not target.host_ranks and target.mapped is None and error in target.host_error
        copies = pusher.machine.mover.num_host_copies
        request = random_request(f"nixl-{change}", *GROUPS, 48, np.random.default_rng(4))
        cluster.reset_decode()
        (capability,) = cluster.expect(request)
        assert _push(cluster, target, request, capability).ok
        assert cluster.check(request) == [] and pusher.machine.mover.num_host_copies == copies
    finally:
        cluster.connect()  # the mapped connection again, for the other cases


def test_a_gpu_target_is_not_mapped(cluster):
    writer, target = cluster.prefill[0].cache, cluster.decode[0].cache
    plan = PushPlan(writer, target)
    with pytest.raises(TransferError, match="host memory only"):
        open_push_target(writer, dataclasses.replace(target, mem_type="VRAM"), [plan.copy_plan], None)


def test_a_closed_connection_unmaps_the_target_and_a_copy_into_it_is_refused(cluster):
    """Disconnecting closes the mapping under the executor's lock; a rank still holding it refuses to copy
    (the addresses may be another mapping's by then) instead of writing there."""
    pusher = cluster.pushers[0]
    key = next(iter(pusher.targets))
    host_rank = pusher.targets[key].host_ranks[0]
    try:
        pusher.disconnect(key)
        assert host_rank.source.closed
        request = random_request("closed", *GROUPS, 48, np.random.default_rng(5))
        write = PushPlan(cluster.prefill[0].cache, cluster.decode[0].cache).plan_request(PushRequest(
            "closed", request.local_block_ids, request.remote_block_ids, bytes(16), request.num_tokens)).write
        with pytest.raises(TransferError, match="unmapped"):
            host_rank.copy(write)
    finally:
        cluster.connect()
    assert os.path.exists(f"/dev/shm/{cluster.decode[0].cache.memory[0][0].share.name}")


def test_a_target_naming_the_writers_own_memory_is_not_mapped(cluster):
    """A proven peer cannot get the writer to map (and overwrite) an fd of the writer's own process, nor the
    writer engine's own objects; the control: the same target naming only its own objects is mapped."""
    decode = cluster.decode[0].cache
    plan = PushPlan(cluster.prefill[0].cache, decode)
    source, ranks, _ = open_push_target(cluster.prefill[0].cache, decode, [plan.copy_plan], None)
    source.close()
    assert ranks
    own_fd = _with_share(decode, name="", holder_pid=os.getpid(), holder_fd=0)
    for writer, target in ((cluster.prefill[0].cache, own_fd), (decode, decode)):  # its own engine: the writer
        with pytest.raises(TransferError, match="memory of the writer itself"):
            open_push_target(writer, target, [plan.copy_plan], None)
