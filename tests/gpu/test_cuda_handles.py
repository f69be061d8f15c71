"""GPU caches through real daemons: CUDA IPC handles of torch tensors, registered as VRAM.

Runs only where ``torch.cuda.is_available()`` (a CUDA build of torch and a
GPU); skipped elsewhere. Run it on a GPU machine with::

    python -m pytest tests/gpu -q -rs

Each engine rank's cache lives in one CUDA tensor; the daemon opens it from
the tensor's IPC handle. Prefill ranks are tagged on the host and copied to
the GPU; after the read the decode tensors are copied back and checked
byte for byte against the oracle, like the host-memory tests.
"""

import numpy as np
import pytest

import torch

# A mark, not a module-level skip: `-m vllm` (or any marker selection) then deselects these
# tests instead of reporting a skip.
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

from kvxferd.client import DaemonProcess, EngineClient  # noqa: E402
from kvxferd.service.gpu import export_ipc  # noqa: E402
from kvxferd.service.wire import engine_to_pb  # noqa: E402
from kvxferd.verify.engines import allocate_engine, verify_decode  # noqa: E402
from kvxferd.verify.models import ModelShape, model_groups, random_request  # noqa: E402


def _gpu_engine(engine_id, groups, tp, rank, tagged):
    host = allocate_engine(engine_id, groups, tp, rank, tagged=tagged)
    device = torch.from_numpy(host.arena.copy()).cuda()
    if tagged:  # prefill: the bare cudaIpcMemHandle_t of the allocation
        handle, arena_offset = export_ipc(device.data_ptr())
    else:  # decode: torch's own encoding, as an engine sharing a storage gets it
        _device, handle, _size, arena_offset, *_ = device.untyped_storage()._share_cuda_()
    message = engine_to_pb(host.cache, with_addresses=False)
    message.mem_type = "VRAM"
    base = host.arena.ctypes.data
    for group_pb, memory in zip(message.groups, host.cache.memory):
        for region_pb, region in zip(group_pb.regions, memory):
            region_pb.handle.cuda_ipc_handle = handle
            region_pb.handle.offset = arena_offset + region.address - base
            region_pb.device_id = device.device.index
    return host, device, message


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gqa", 2, 1), ("mla", 1, 2)])
def test_vram_reads_through_daemons(tmp_path, model, prefill_tp, decode_tp):
    prefill_groups, decode_groups = model_groups(model, ModelShape())
    daemons = DaemonProcess.start_many([f"g{i}" for i in range(prefill_tp + decode_tp)], socket_dir=str(tmp_path))
    try:
        prefill = [_gpu_engine("gp", prefill_groups, prefill_tp, q, True) for q in range(prefill_tp)]
        decode = [_gpu_engine("gd", decode_groups, decode_tp, r, False) for r in range(decode_tp)]
        clients = [EngineClient(d.engine_target) for d in daemons]
        for client, (_, _, message) in zip(clients, prefill + decode):
            client.register(message)
        request = random_request("g", prefill_groups, decode_groups, 70, np.random.default_rng(0))
        for client in clients[:prefill_tp]:
            client.hold(request.remote_request_id, request.remote_block_ids)
        for client in clients[prefill_tp:]:
            client.handshake("gp", [d.peer_address for d in daemons[:prefill_tp]])
            client.submit_read(request.request_id, "gp", request.remote_request_id, request.local_block_ids,
                               request.remote_block_ids, num_tokens=70)
        for client in clients[prefill_tp:]:
            completion = client.wait_completion(request.request_id)
            assert completion.ok, completion.error
        torch.cuda.synchronize()
        for host, device, _ in decode:
            host.arena[...] = device.cpu().numpy()
        assert verify_decode([h for h, _, _ in decode], prefill_groups, request) == ([], 0)
        for client in clients:
            client.deregister()
            client.close()
    finally:
        for daemon in daemons:
            daemon.terminate()
