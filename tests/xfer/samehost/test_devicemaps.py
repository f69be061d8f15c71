"""Same-host reads of GPU caches (issue #37) through real NIXL executors and boards, the driver played.

No GPU here: the CUDA driver's calls are played on host memory
(tests/cuda/fake_driver.py) and each prefill rank's "allocation" is its
host arena. Everything else is what a daemon runs: the reader's
``SameHostOpener`` makes the copier and opens the holder's memory, the
executor posts the rank's batch, polls its event beside NIXL transfers,
checks the holder's board before and after, and the oracle checks every
byte. tests/gpu runs the real driver where a GPU is lent.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvxferd.cuda.copies import BatchCopier
from kvxferd.cuda.ipc import IpcAllocation
from kvxferd.errors import TransferError, UnavailableError
from kvxferd.plan.groups import DeviceShare
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.samehost import devicemaps, ranks as samehostranks
from kvxferd.xfer.samehost.devicemaps import PendingDeviceCopy, map_device_source
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.samehost.ranks import SameHostOpener
from kvxferd.rig.reading import post, wait
from tests.cuda.fake_driver import FakeDriver

GROUPS = model_groups("gqa", ModelShape())
UUID = "GPU-00000000-1111-2222-3333-444444444444"
LOCAL_GPU = 3  # the reader's GPU index (its cache's regions say so)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(*GROUPS, 2, 1, name="devicemaps") as cluster:
        yield cluster


def _device_cache(cache, base: int, handle: bytes):
    """``cache`` as a same-host holder names it on a GPU: each region in one IPC allocation at ``base``."""
    memory = tuple(tuple(dataclasses.replace(r, share=DeviceShare(handle, r.address - base, UUID),
                                             device_id=LOCAL_GPU) for r in regions) for regions in cache.memory)
    return dataclasses.replace(cache, memory=memory, mem_type="VRAM")


class Opener:
    """Opens an engine's arena as if it were its IPC allocation; records opens and closes, and whether any
    batch was still pending on the played device when an allocation closed."""

    def __init__(self, cluster, driver: FakeDriver, log: list):
        self.arenas = {bytes([q]) * 64: engine.arena for q, engine in enumerate(cluster.prefill)}
        self.driver, self.log = driver, log

    def __call__(self, handle, device_id, field):
        arena = self.arenas[handle]
        self.log.append(("open", handle[0], device_id))

        def close():
            self.log.append(("close", handle[0], len(self.driver.pending)))

        return IpcAllocation(arena.ctypes.data, arena.nbytes, close)


def _use_device_ranks(cluster, driver: FakeDriver, monkeypatch, log: list | None = None) -> SameHostOpener:
    """Connect afresh, then open every prefill rank as a GPU holder through the reader's SameHostOpener."""
    cluster.connect()
    log = [] if log is None else log
    monkeypatch.setattr(samehostranks, "BatchCopier", lambda device_id: BatchCopier(device_id, lib=driver))
    monkeypatch.setattr(devicemaps, "open_ipc_allocation", Opener(cluster, driver, log))
    executor = cluster.executors[0]
    opener = SameHostOpener(_device_cache(executor.cache, 0, b""))  # the reader's cache, as VRAM on LOCAL_GPU
    remote = executor.remote(cluster.prefill_id)
    for rank_plan in remote.plan.rank_plans:
        q = rank_plan.remote_rank
        engine = cluster.prefill[q]
        remote.host_ranks[q], _ = opener.open(_device_cache(engine.cache, engine.arena.ctypes.data, bytes([q]) * 64),
                                              rank_plan)  # (no board given: its checks stay NIXL READs)
    assert opener.device_copier.device_id == LOCAL_GPU
    return opener


def _request(request_id: str, seed: int):
    return random_request(request_id, *GROUPS, 48, np.random.default_rng(seed))


def _post_until_copying(cluster, request, driver):
    """Post ``request`` and poll until both ranks' batches run (their boards showed the hold). The played
    device holds every batch meanwhile: with a lag alone, a loaded machine's late second board check let
    the first batch end first, and the read was over before both were seen in flight."""
    executor = cluster.executors[0]
    driver.paused = True
    try:
        inflight = post(executor, cluster.prefill_id, request)
        deadline = time.monotonic() + 10
        while sum(isinstance(r.handle, PendingDeviceCopy) for r in inflight.ranks.values()) < 2:  # test-side: which kind
            assert executor.poll(inflight) is None and time.monotonic() < deadline
            time.sleep(1e-3)
    finally:
        driver.paused = False
    return inflight


def test_device_copies_are_byte_exact_one_batch_per_rank_polled_like_nixl(cluster, monkeypatch):
    driver = FakeDriver(lag=3)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    executor = cluster.executors[0]
    before = executor.num_host_copies
    request = _request("device", 1)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == []
    assert executor.num_host_copies == before + 2
    assert len(driver.batch_sizes) == 2 + 2  # one check copy per allocation at connect, one batch per rank
    assert driver.calls.count("cuEventQuery") >= 2 * 4  # not done until the played device said so
    opener.close()
    cluster.connect()


def test_negative_control_a_wrong_device_copy_is_caught_by_the_oracle(cluster, monkeypatch):
    driver = FakeDriver(lag=0)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    driver.corrupt = True
    request = _request("corrupt", 2)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) != []
    opener.close()
    cluster.connect()


def test_the_hold_ending_while_the_batch_runs_makes_the_read_stale(cluster, monkeypatch):
    """The board is read again only once the event said done: a hold released under a running batch is
    seen, and the read is STALE (its blocks invalid), never reported fine."""
    driver = FakeDriver(lag=20)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    request = cluster.hold(_request("device-stale", 6))
    inflight = _post_until_copying(cluster, request, driver)
    for holder in cluster.holders:
        with holder.lock:
            holder.holds.release(request.remote_request_id)
    result = wait(cluster.executors[0], inflight, 10)
    assert not result.ok and result.failure is ReadFailure.STALE
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)
    opener.close()
    cluster.connect()


def test_a_device_fault_fails_the_read_and_sends_every_gpu_rank_back_to_nixl(cluster, monkeypatch):
    driver = FakeDriver(lag=2)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    request = cluster.hold(_request("device-error", 3))
    inflight = _post_until_copying(cluster, request, driver)
    driver.event_code = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the context is poisoned
    executor = cluster.executors[0]
    result = wait(executor, inflight, 10)
    assert not result.ok and result.failure is ReadFailure.TRANSFER and "device reported an error" in result.error
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)
    remote = executor.remote(cluster.prefill_id)
    assert not remote.host_ranks and all("700" in e for e in remote.host_errors.values())
    engine = cluster.prefill[0]
    with pytest.raises(TransferError, match="no device copies any more"):  # nor at the next handshake
        opener.open(_device_cache(engine.cache, engine.arena.ctypes.data, b"\0" * 64), remote.plan.rank_plans[0])
    driver.event_code = 0
    request = _request("after-fault", 7)
    cluster.reset_decode()
    (result,) = cluster.read(request)  # over NIXL now, as exact
    assert result.ok and cluster.check(request) == []
    cluster.connect()


def test_a_batch_the_driver_refuses_goes_over_nixl_now_and_from_then_on(cluster, monkeypatch):
    driver = FakeDriver(lag=0)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    driver.batch_code = 801  # CUDA_ERROR_NOT_SUPPORTED: nothing of the batch runs
    request = _request("refused", 8)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == []
    remote = cluster.executors[0].remote(cluster.prefill_id)
    assert not remote.host_ranks and all("refused a batch" in e for e in remote.host_errors.values())
    opener.close()
    cluster.connect()


def test_a_deadline_under_a_running_copy_waits_for_it_before_the_read_ends(cluster, monkeypatch):
    """Aborted at its deadline: the batch still runs on the device and writes the engine's blocks, so the
    read ends (blocks reusable) only after the copier waited for it."""
    driver = FakeDriver(lag=10**9)
    opener = _use_device_ranks(cluster, driver, monkeypatch)
    inflight = _post_until_copying(cluster, cluster.hold(_request("device-deadline", 4)), driver)
    result = wait(cluster.executors[0], inflight, 0.05)
    assert not result.ok and result.failure is ReadFailure.DEADLINE
    assert driver.calls.count("cuEventSynchronize") == 2 + 2 and not driver.pending  # (2 check copies at connect)
    opener.close()
    cluster.connect()


def test_releasing_the_holders_memory_drains_the_stream_before_any_allocation_closes(cluster, monkeypatch):
    log: list = []
    driver = FakeDriver(lag=10**9)
    opener = _use_device_ranks(cluster, driver, monkeypatch, log)
    assert [entry for entry in log if entry[0] == "open"] == [("open", 0, LOCAL_GPU), ("open", 1, LOCAL_GPU)]
    executor = cluster.executors[0]
    _post_until_copying(cluster, cluster.hold(_request("in-flight", 9)), driver)  # two batches still on the stream
    assert len(driver.pending) == 2
    executor.release_host_memory(executor.remote(cluster.prefill_id), "the holder changed")
    assert [entry for entry in log if entry[0] == "close"] == [("close", 0, 0), ("close", 1, 0)]  # none pending
    opener.close()
    assert driver.calls[-1] == "cuDevicePrimaryCtxRelease"
    cluster.connect()


def test_what_cannot_be_opened_or_copied_is_refused_with_the_reason(cluster):
    log: list = []
    driver = FakeDriver()
    copier = BatchCopier(0, lib=driver)
    engine = cluster.prefill[0]
    cache = _device_cache(engine.cache, engine.arena.ctypes.data, b"\0" * 64)
    opener = Opener(cluster, driver, log)
    opener.arenas[b"\0" * 64] = engine.arena

    def not_openable(handle, device_id, field):
        raise UnavailableError(field, "cudaIpcOpenMemHandle failed: invalid device context (201)")

    with pytest.raises(TransferError, match="invalid device context"):
        map_device_source(cache, copier, open_allocation=not_openable)
    host = dataclasses.replace(cache, mem_type="DRAM")
    with pytest.raises(TransferError, match="CUDA IPC handle"):
        map_device_source(host, copier, open_allocation=opener)
    small = Opener(cluster, driver, log)
    small.arenas = {b"\0" * 64: engine.arena[:4096]}
    with pytest.raises(TransferError, match="exceeds the memory"):
        map_device_source(cache, copier, open_allocation=small)
    assert [e[:2] for e in log].count(("close", 0)) == 1  # what was opened is closed again on the way out
    driver.event_code = 700
    with pytest.raises(TransferError, match="copying from the holder's GPU memory"):
        map_device_source(cache, copier, open_allocation=opener)  # the check copy at connect
    with pytest.raises(TransferError, match="mem_type|DRAM memory is read into VRAM"):
        SameHostOpener(cache).open(engine.cache, None)
