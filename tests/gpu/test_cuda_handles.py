"""GPU caches through real daemons: CUDA IPC handles of torch tensors, registered as VRAM.

Runs only where ``torch.cuda.is_available()`` (a CUDA build of torch and a
GPU); skipped elsewhere. Run it on a GPU machine with::

    python -m pytest tests/gpu -q -rs

Each engine rank's cache lives in one CUDA tensor; the daemon opens it from
the tensor's IPC handle. Prefill ranks are tagged on the host and copied to
the GPU; after the read the decode tensors are copied back and checked
byte for byte against the oracle, like the host-memory tests.
"""

import contextlib
import ctypes
import types

import grpc
import numpy as np
import pytest

import torch

# A mark, not a module-level skip: `-m vllm` (or any marker selection) then deselects these
# tests instead of reporting a skip.
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

from kvxferd.client import DaemonProcess, EngineClient  # noqa: E402
from kvxferd.client.fdsend import send_fds
from kvxferd.wire.names import fd_socket_path  # noqa: E402
from kvxferd.client.gpu import export_ipc  # noqa: E402
from kvxferd.cuda.driver import AccessDesc, Location  # noqa: E402
from kvxferd.cuda.vmm import AllocationProp, AllocFlags  # noqa: E402
from kvxferd.rig.verify.buffers import allocate_engine, verify_decode  # noqa: E402
from kvxferd.rig.verify.gpu import GpuEngine  # noqa: E402
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request  # noqa: E402
from kvxferd.wire.messages import engine_to_pb  # noqa: E402


def _gpu_engine(engine_id, groups, tp, rank, tagged):
    engine = GpuEngine.allocate(engine_id, groups, tp, rank, tagged=tagged)
    # prefill: the bare cudaIpcMemHandle_t of the allocation; decode: torch's own encoding, as an
    # engine sharing a storage gets it
    return engine, engine.register_pb(export_ipc(engine.tensor.data_ptr()) if tagged else None)


@contextlib.contextmanager
def _gpu_pair(tmp_path, prefix: str, model: str, prefill_tp: int, decode_tp: int, extra_args=()):
    """A prefill engine ``<prefix>p`` and a decode engine ``<prefix>d`` with their caches on the GPU, one daemon
    per rank, every rank registered; the decode ranks have not handshaken yet. Deregistered when the test's
    body ends normally, the daemons stopped in any case."""
    prefill_groups, decode_groups = model_groups(model, ModelShape())
    daemons = DaemonProcess.start_many([f"{prefix}{i}" for i in range(prefill_tp + decode_tp)],
                                       socket_dir=str(tmp_path), extra_args=extra_args)
    try:
        prefill = [_gpu_engine(f"{prefix}p", prefill_groups, prefill_tp, q, True) for q in range(prefill_tp)]
        decode = [_gpu_engine(f"{prefix}d", decode_groups, decode_tp, r, False) for r in range(decode_tp)]
        clients = [EngineClient(d.engine_target) for d in daemons]
        for client, (_, message) in zip(clients, prefill + decode):
            client.register(message)
        yield types.SimpleNamespace(prefill_groups=prefill_groups, decode_groups=decode_groups, daemons=daemons,
                                    decode=decode, prefill_clients=clients[:prefill_tp],
                                    decode_clients=clients[prefill_tp:],
                                    prefill_addresses=[d.peer_address for d in daemons[:prefill_tp]])
        for client in clients:
            client.deregister()
            client.close()
    finally:
        for daemon in daemons:
            daemon.terminate()


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "nixl"])
@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gqa", 2, 1), ("mla", 1, 2)])
def test_vram_reads_through_daemons(tmp_path, model, prefill_tp, decode_tp, same_host):
    """Byte-exact both ways: the decode daemons copying from the prefill engine's allocation themselves
    (CUDA IPC handles from the holder, batched device copies: issue #37), or over NIXL."""
    with _gpu_pair(tmp_path, "g", model, prefill_tp, decode_tp,
                   () if same_host else ("--no-same-host-reads",)) as pair:
        request = random_request("g", pair.prefill_groups, pair.decode_groups, 70, np.random.default_rng(0))
        # issue #35: a read carries each prefill rank's capability for the hold, in rank order
        capabilities = [client.hold(request.remote_request_id, request.remote_block_ids).capability
                        for client in pair.prefill_clients]
        for client in pair.decode_clients:
            client.handshake("gp", pair.prefill_addresses)
            client.submit_read(request.request_id, "gp", request.remote_request_id, request.local_block_ids,
                               request.remote_block_ids, num_tokens=70, remote_capabilities=capabilities)
        for client in pair.decode_clients:
            completion = client.reads.wait_completion(request.request_id)
            assert completion.ok, completion.error
        for engine, _ in pair.decode:
            engine.download()
        assert verify_decode([engine.host for engine, _ in pair.decode], pair.prefill_groups, request) == ([], 0)
        copies = sum(d.metric("kvxferd_same_host_copies_total") for d in pair.daemons[prefill_tp:])
        assert copies == (max(prefill_tp, decode_tp) if same_host else 0)  # every rank read, one way or the other


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gqa", 2, 1), ("mla", 1, 2)])
def test_vram_pushes_through_daemons(tmp_path, model, prefill_tp, decode_tp):
    """Push (issue #57) between GPU caches: the decode ranks expect, the prefill daemons WRITE over NIXL into
    the decode engine's CUDA allocation (imported from its IPC handle), byte-exact; a push of another
    prompt's KV (the negative control) is caught by the same check."""
    from kvxferd.plan.capability import push_key_digest

    with _gpu_pair(tmp_path, "w", model, prefill_tp, decode_tp) as pair:
        for client in pair.decode_clients:
            client.handshake("wp", pair.prefill_addresses)
        rng = np.random.default_rng(3)
        request = random_request("w", pair.prefill_groups, pair.decode_groups, 70, rng)
        other = random_request("o", pair.prefill_groups, pair.decode_groups, 70, rng)
        wrong = []
        for n, held in enumerate((request, other)):  # the right KV, then another prompt's under the same transfer
            transfer_id, key = f"{request.remote_request_id}-{n}", bytes([n + 1]) * 16
            for client in pair.decode_clients:
                client.submit_push(f"{request.request_id}-{n}", "wp", transfer_id, key, request.local_block_ids,
                                   num_tokens=70)
            for client in pair.prefill_clients:
                client.hold(transfer_id, held.remote_block_ids, push_key_digest=push_key_digest(key))
            for client in pair.decode_clients:
                completion = client.reads.wait_completion(f"{request.request_id}-{n}")
                assert completion.ok, completion.error
            for engine, _ in pair.decode:
                engine.download()
            wrong.append(verify_decode([engine.host for engine, _ in pair.decode], pair.prefill_groups, request))
        assert wrong[0] == ([], 0)
        assert wrong[1][1] > 0  # another prompt's KV pushed: the oracle sees it


def test_an_ipc_region_beyond_its_allocation_is_refused(tmp_path):
    """Issue 11: a region must lie inside the shared allocation (no reading the memory around it)."""
    groups = model_groups("gqa", ModelShape())[0]
    daemon = DaemonProcess("gb", socket_dir=str(tmp_path))
    try:
        engine, message = _gpu_engine("gbig", groups, 1, 0, False)  # engine: kept alive while registering
        message.groups[0].regions[-1].handle.offset += 1 << 40  # far past the end of the allocation
        client = EngineClient(daemon.engine_target)
        try:
            with pytest.raises(Exception) as refused:
                client.register(message)
            assert refused.value.code().name == "INVALID_ARGUMENT", refused.value
            assert "exceeds the shared allocation" in refused.value.details(), refused.value.details()
        finally:
            client.close()
        assert engine.tensor.is_cuda
    finally:
        daemon.terminate()


class _VmmAllocation:
    """A CUDA VMM allocation exportable as a POSIX fd, mapped in this process (what an engine would share)."""

    def __init__(self, num_bytes: int, device_id: int = 0) -> None:
        torch.zeros(1, device=f"cuda:{device_id}")  # the primary context, current on this thread
        self.cuda = cuda = ctypes.CDLL("libcuda.so.1")

        # pinned, POSIX fd, on the device (not RDMA-capable: a plain shareable allocation)
        prop = AllocationProp(1, 1, Location(1, device_id), None, AllocFlags())
        granularity = ctypes.c_size_t()
        assert cuda.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0) == 0
        self.size = -(-num_bytes // granularity.value) * granularity.value
        self.handle = ctypes.c_ulonglong()
        assert cuda.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(self.size), ctypes.byref(prop),
                                ctypes.c_ulonglong(0)) == 0
        fd = ctypes.c_int()
        assert cuda.cuMemExportToShareableHandle(ctypes.byref(fd), self.handle, 1, ctypes.c_ulonglong(0)) == 0
        self.fd = fd.value
        self.address = ctypes.c_ulonglong()
        assert cuda.cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                        ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)) == 0
        assert cuda.cuMemMap(self.address, ctypes.c_size_t(self.size), ctypes.c_size_t(0), self.handle,
                             ctypes.c_ulonglong(0)) == 0
        access = AccessDesc(Location(1, device_id), 3)
        assert cuda.cuMemSetAccess(self.address, ctypes.c_size_t(self.size), ctypes.byref(access), ctypes.c_size_t(1)) == 0

    def copy(self, host: np.ndarray, to_device: bool) -> None:
        ptr = ctypes.c_ulonglong(self.address.value)
        if to_device:
            assert self.cuda.cuMemcpyHtoD_v2(ptr, host.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(host.nbytes)) == 0
        else:
            assert self.cuda.cuMemcpyDtoH_v2(host.ctypes.data_as(ctypes.c_void_p), ptr, ctypes.c_size_t(host.nbytes)) == 0


def test_vmm_fd_regions_read_through_daemons_and_are_bounds_checked(tmp_path):
    """Engines share their caches as CUDA VMM fds over the fd socket; a region past the allocation is refused."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape())
    daemons = DaemonProcess.start_many(["v0", "v1"], socket_dir=str(tmp_path))
    clients = [EngineClient(d.engine_target) for d in daemons]
    try:
        engines = []
        for daemon, (engine_id, groups, tagged) in zip(daemons, (("vp", prefill_groups, True), ("vd", decode_groups, False))):
            host = allocate_engine(engine_id, groups, 1, 0, tagged=tagged)
            vmm = _VmmAllocation(host.arena.nbytes)
            vmm.copy(host.arena, to_device=True)
            message = engine_to_pb(host.cache, with_addresses=False)
            message.mem_type = "VRAM"
            for group_pb, memory in zip(message.groups, host.cache.memory):
                for region_pb, region in zip(group_pb.regions, memory):
                    region_pb.handle.cuda_vmm_fd_index = 0
                    region_pb.handle.allocation_bytes = vmm.size
                    region_pb.handle.offset = region.address - host.arena.ctypes.data
                    region_pb.device_id = 0
            engines.append((daemon, host, vmm, message))
        # Bounds: a region pushed past the end of its allocation; an allocation claimed larger than it is.
        daemon, _host, vmm, message = engines[0]
        for n, (name, value) in enumerate((("offset", vmm.size), ("allocation_bytes", 2 * vmm.size))):
            bad = type(message)()
            bad.CopyFrom(message)
            setattr(bad.groups[0].regions[-1].handle, name, value)
            send_fds(fd_socket_path(daemon.socket), f"bad{n}", [vmm.fd])
            with pytest.raises(grpc.RpcError) as refused:
                clients[0].register(bad, fd_token=f"bad{n}")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "allocation" in refused.value.details(), refused.value.details()
        for client, (daemon, _host, vmm, message) in zip(clients, engines):
            send_fds(fd_socket_path(daemon.socket), "ok", [vmm.fd])
            client.register(message, fd_token="ok")
        request = random_request("v", prefill_groups, decode_groups, 70, np.random.default_rng(1))
        capability = clients[0].hold(request.remote_request_id, request.remote_block_ids).capability
        clients[1].handshake("vp", [daemons[0].peer_address])
        clients[1].submit_read(request.request_id, "vp", request.remote_request_id, request.local_block_ids,
                               request.remote_block_ids, num_tokens=70, remote_capabilities=[capability])
        completion = clients[1].reads.wait_completion(request.request_id)
        assert completion.ok, completion.error
        _daemon, decode_host, decode_vmm, _ = engines[1]
        torch.cuda.synchronize()
        decode_vmm.copy(decode_host.arena, to_device=False)
        assert verify_decode([decode_host], prefill_groups, request) == ([], 0)
    finally:
        for client in clients:
            client.close()
        for daemon in daemons:
            daemon.terminate()


def test_bench_gpu_quick_reads_byte_exact_and_reports_both_paths():
    """``kvxferd bench gpu --quick``: VRAM reads through the daemons and over raw NIXL, the checked read exact."""
    from kvxferd.rig.bench import gpu as gpu_bench

    figures = gpu_bench.run(**gpu_bench.QUICK)
    bulk, small = figures["bulk"], figures["per_request"]
    assert bulk["byte_exact"], bulk["problems"]
    assert bulk["same_host_byte_exact"], bulk["same_host_problems"]
    assert figures["same_host_copies"]["nixl_daemon"] == 0 and figures["same_host_copies"]["same_host_daemon"] > 0
    assert bulk["bytes"] == 8 * 64 * 64 * 1024  # QUICK: 8 layers x 64 blocks of 64 KiB
    for key in ("device_copy_gbps", "own_memory_gbps", "raw_gbps", "daemon_gbps", "ratio"):
        assert bulk[key] > 0, key
    assert small["raw"]["p50_us"] > 0 and small["daemon"]["p50_us"] > 0
    print(gpu_bench.format_table(figures))


def test_memory_cuda_ipc_cannot_share_is_exported_as_a_vmm_fd():
    """vLLM's sleep mode allocates with cuMemCreate: export_region falls back to the allocation's fd."""
    from kvxferd.client.gpu import export_region
    from kvxferd.service.engines.gpu import import_vmm

    vmm = _VmmAllocation(4 << 20)
    data = np.arange(vmm.size, dtype=np.uint8)
    vmm.copy(data, to_device=True)
    exported = export_region(vmm.address.value + 4096, 8192)
    assert exported.ipc_handle == b"" and exported.vmm_fd >= 0
    assert (exported.offset, exported.allocation_bytes) == (4096, vmm.size)
    mapping = import_vmm(exported.vmm_fd, exported.offset, 8192, 0, "r", allocation_bytes=exported.allocation_bytes)
    try:
        seen = np.zeros(8192, dtype=np.uint8)
        assert vmm.cuda.cuMemcpyDtoH_v2(seen.ctypes.data_as(ctypes.c_void_p), ctypes.c_ulonglong(mapping.memory.address),
                                        ctypes.c_size_t(8192)) == 0
        assert np.array_equal(seen, data[4096:4096 + 8192])
    finally:
        mapping.close()
