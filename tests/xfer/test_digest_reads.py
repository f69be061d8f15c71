"""Reads checked against their holders' digests over real NIXL (issue #59): the executor fails a read whose
blocks differ from what was held, naming those blocks, where the board checks and NIXL saw nothing wrong.

Each fault is shown three ways: the read with digests fails (CORRUPT, the right blocks invalid), the byte
oracle confirms the decode blocks are wrong, and the same fault without digests completes ok (the silent
pass the digests exist for)."""

import dataclasses

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.holddigests import HoldDigests, digest_hold
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.damage import element_offset
from kvxferd.rig.verify.models import model_groups, random_request
from kvxferd.rig.verify.models import ModelShape
from kvxferd.xfer.handles import ReadFailure


def hold_digests(engine, request) -> bytes:
    return digest_hold(engine.cache, engine.buffers, request.remote_block_ids).encode()


@pytest.fixture(scope="module")
def cluster():
    prefill_groups, decode_groups = model_groups("hybrid", ModelShape())
    with LocalCluster(prefill_groups, decode_groups, 2, 2, name="digest-reads") as cluster:
        yield cluster


def held_with_digests(cluster, name, seed):
    request = cluster.hold(random_request(name, cluster.prefill_groups, cluster.decode_groups, 70,
                                          np.random.default_rng(seed), cached_tokens=16))
    digests = tuple(HoldDigests.decode(hold_digests(engine, request)) for engine in cluster.prefill)
    return request, dataclasses.replace(request, remote_digests=digests)


def flip_last_block(cluster, request, rank=1):
    """A bit of the last held block of the first group, layer 1, on prefill rank ``rank``, flips."""
    engine = cluster.prefill[rank]
    offset, _ = element_offset(engine, 0, int(request.remote_block_ids[0][-1]))
    engine.buffers[0][1][offset + 5] ^= 0x40


def test_a_clean_read_with_digests_is_checked_and_ok(cluster):
    _, request = held_with_digests(cluster, "clean", 1)
    before = [e.digests.num_reads_checked for e in cluster.executors]
    cluster.reset_decode()
    results = cluster.read(request, hold=False)
    assert [r.error for r in results] == [None, None] and cluster.check(request) == []
    assert [e.digests.num_reads_checked - b for e, b in zip(cluster.executors, before)] == [1, 1]
    assert all(e.digests.num_atoms_checked > 0 and e.digests.num_units_unverifiable == 0 for e in cluster.executors)


def test_a_bit_flipped_after_the_hold_fails_the_read_at_its_block(cluster):
    plain, request = held_with_digests(cluster, "flipped", 2)
    flip_last_block(cluster, request)
    cluster.reset_decode()
    results = cluster.read(request, hold=False)
    assert cluster.check(request) != []  # the fault is real: a decode byte is wrong
    corrupt = [r for r in results if not r.ok]
    assert corrupt and all(r.failure is ReadFailure.CORRUPT and r.failed_ranks == (1,) for r in corrupt)
    assert all(r.invalid_block_ids[0].tolist() == [int(request.local_block_ids[0][-1])] for r in corrupt)
    assert all(len(ids) == 0 for r in corrupt for ids in r.invalid_block_ids[1:])


def test_without_digests_the_same_fault_passes_silently(cluster):
    plain, request = held_with_digests(cluster, "silent", 3)
    flip_last_block(cluster, request)
    cluster.reset_decode()
    results = cluster.read(plain, hold=False)
    assert all(r.ok for r in results) and cluster.check(plain) != []


def test_an_engine_writing_into_a_held_block_fails_the_read(cluster):
    plain, request = held_with_digests(cluster, "overwritten", 4)
    engine = cluster.prefill[0]
    offset, _ = element_offset(engine, 0, int(request.remote_block_ids[0][-2]))
    engine.buffers[0][0][offset:offset + 512] = 7  # a new request's prefill into a held block
    cluster.reset_decode()
    results = cluster.read(request, hold=False)
    assert cluster.check(request) != []
    assert any(not r.ok and r.failure is ReadFailure.CORRUPT for r in results)
    assert all(int(request.local_block_ids[0][-2]) in r.invalid_block_ids[0].tolist() for r in results if not r.ok)


def test_digests_of_another_engine_size_are_refused_before_anything_moves(cluster):
    _, request = held_with_digests(cluster, "wrong-count", 5)
    with pytest.raises(InvalidArgumentError) as err:
        cluster.read(dataclasses.replace(request, remote_digests=request.remote_digests[:1]), hold=False)
    assert err.value.field == "remote_digests"


def test_a_read_with_digests_into_memory_this_process_cannot_read_is_refused(cluster, monkeypatch):
    """A GPU cache's blocks cannot be digested here yet: such a read is refused before anything moves, never
    read unchecked (and a GPU cache has no host views)."""
    from kvxferd.errors import UnavailableError
    from kvxferd.xfer.verify import host_memories

    assert host_memories(dataclasses.replace(cluster.executors[0].cache, mem_type="VRAM")) is None
    _, request = held_with_digests(cluster, "no-host-views", 6)
    monkeypatch.setattr(cluster.executors[0], "_memories", None)
    with pytest.raises(UnavailableError):
        cluster.read(request, hold=False)


def test_a_read_whose_units_are_not_whole_digest_atoms_is_refused_with_digests_and_writes_nothing():
    """Decode blocks of 4 tokens against 16-token prefill blocks read half digest atoms: with digests such a
    read is refused (FAILED_PRECONDITION) before anything moves, never completed as if checked; without
    them it reads as any other."""
    from kvxferd.errors import UnavailableError

    shape = ModelShape(num_layers=1, num_kv_heads=2, head_size=32, block_size=4, prefill_block_size=16,
                       decode_block_size=4, num_blocks=64)
    prefill_groups, decode_groups = model_groups("gqa", shape)
    with LocalCluster(prefill_groups, decode_groups, 1, 1, name="half-atoms") as cluster:
        plain, request = held_with_digests(cluster, "half-atoms", 7)
        cluster.reset_decode()
        with pytest.raises(UnavailableError, match="not whole digest atoms"):
            cluster.read(request, hold=False)
        assert cluster.decode_untouched()
        assert all(r.ok for r in cluster.read(plain, hold=False)) and cluster.check(plain) == []
