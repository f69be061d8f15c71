"""The memory-model probe of ``scripts/gpu-check.sh``: how each way of sharing a GPU cache fares (issue #56).

For each candidate an *owner* process allocates and fills 64 MiB and a
*holder* process (the daemon's place) opens it, tries what a NIC or UCX
would need, registers it with NIXL and serves it; this process READs it
over NIXL into its own device memory and checks the bytes::

    legacy_ipc     owner cudaMalloc ──IPC handle──► holder cudaIpcOpenMemHandle
    vmm_fd         owner cuMemCreate(RDMA, POSIX_FD) ──fd──► holder imports and maps
    daemon_owned   holder cuMemCreate(RDMA, POSIX_FD), the engine (owner) imports it

Per candidate: can the holder export it again (what a restarted daemon or
UCX's cuda_ipc needs), does ``cuMemGetHandleForAddressRange(DMA_BUF_FD)``
succeed on the holder's mapping (NIC registration without nvidia-peermem),
which path UCX took for the READ (its own report: this process runs with
``UCX_PROTO_INFO=y`` and ``UCX_LOG_FILE`` set by the script) and GB/s.
Needs a CUDA GPU; everything here is plain driver calls through ctypes.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

from kvxferd.cuda.driver import IpcHandle, check_drv, check_rt, cuda, cudart
from kvxferd.cuda.vmm import make_current

CANDIDATES = ("legacy_ipc", "vmm_fd", "daemon_owned")
NUM_BYTES = 64 << 20
DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
ROUNDS = 3
BUDGET_S = 25.0  # per candidate, all of it: three fit scripts/gpu-check.sh's limit for the probe


def _context(device_id: int = 0):
    lib = cuda("device_id")
    make_current(lib, device_id, "device_id")
    return lib


def pattern(num_bytes: int) -> np.ndarray:
    return np.random.default_rng(56).integers(0, 256, num_bytes, dtype=np.uint8)


def _fill(lib, address: int, data: np.ndarray) -> None:
    check_drv(lib.cuMemcpyHtoD_v2(ctypes.c_uint64(address), data.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_size_t(data.nbytes)), "cuMemcpyHtoD", "probe")


def _try(call) -> str:
    """"ok", or what failed."""
    try:
        call()
        return "ok"
    except Exception as err:  # noqa: BLE001 - a probe records every failure as data
        return f"{type(err).__name__}: {err}"[:200]


def _dma_buf(lib, address: int, num_bytes: int) -> None:
    fd = ctypes.c_int(-1)
    check_drv(lib.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(address), ctypes.c_size_t(num_bytes),
                                                DMA_BUF_FD, ctypes.c_ulonglong(0)), "cuMemGetHandleForAddressRange",
              "probe")
    os.close(fd.value)


def _export_again(lib, kind: str, address: int) -> None:
    if kind == "legacy_ipc":
        rt, handle = cudart("probe"), IpcHandle()
        check_rt(rt, rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(address)), "cudaIpcGetMemHandle",
                 "probe")
        return
    from kvxferd.client.gpu import export_vmm
    os.close(export_vmm(address, NUM_BYTES, "probe", lib).vmm_fd)  # retain the imported handle, export it


def owner(kind: str, peer, control) -> None:
    """The engine's place: allocate and share (or, daemon_owned, import what the holder allocated)."""
    lib = _context()
    data = pattern(NUM_BYTES)
    if kind == "legacy_ipc":
        pointer = ctypes.c_uint64()
        check_drv(lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(NUM_BYTES)), "cuMemAlloc", "probe")
        _fill(lib, pointer.value, data)
        from kvxferd.client.gpu import export_ipc
        peer.send(export_ipc(pointer.value, "probe"))
    elif kind == "vmm_fd":
        from kvxferd.client.gpu import ShareableAllocator, export_vmm
        address = ShareableAllocator(0, lib).allocate(NUM_BYTES)
        _fill(lib, address, data)
        export = export_vmm(address, NUM_BYTES, "probe", lib)
        send_handle(peer, export.vmm_fd, peer.recv())
        peer.send(export.allocation_bytes)
    else:  # daemon_owned: the engine maps the holder's allocation and sees its bytes
        from kvxferd.service.engines.gpu import import_vmm
        peer.send(os.getpid())
        fd = recv_handle(peer)
        mapping = import_vmm(fd, 0, NUM_BYTES, 0, "probe", allocation_bytes=peer.recv())
        seen = np.empty(NUM_BYTES, np.uint8)
        check_drv(lib.cuMemcpyDtoH_v2(seen.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(mapping.memory.address),
                                      ctypes.c_size_t(NUM_BYTES)), "cuMemcpyDtoH", "probe")
        control.send({"engine_imported": "ok" if np.array_equal(seen, data) else "bytes differ"})
    control.recv()  # hold it until the reader is done


def holder(kind: str, peer, control) -> None:
    """The daemon's place: open the engine's memory (or allocate it), try what a NIC or UCX needs, serve it."""
    lib = _context()
    from kvxferd.service.engines import gpu
    from kvxferd.xfer.nixl.nixl_module import nixl_api
    if kind == "legacy_ipc":
        handle, offset = peer.recv()
        address = gpu.open_ipc(handle, offset, NUM_BYTES, 0, "probe").memory.address
    elif kind == "vmm_fd":
        peer.send(os.getpid())
        fd = recv_handle(peer)
        address = gpu.import_vmm(fd, 0, NUM_BYTES, 0, "probe", allocation_bytes=peer.recv()).memory.address
    else:
        from kvxferd.client.gpu import ShareableAllocator, export_vmm
        address = ShareableAllocator(0, lib).allocate(NUM_BYTES)
        _fill(lib, address, pattern(NUM_BYTES))
        export = export_vmm(address, NUM_BYTES, "probe", lib)
        send_handle(peer, export.vmm_fd, peer.recv())
        peer.send(export.allocation_bytes)
    found = {"export_again": _try(lambda: _export_again(lib, kind, address)),
             "dma_buf": _try(lambda: _dma_buf(lib, address, NUM_BYTES))}
    api = nixl_api()[0]
    agent = api.nixl_agent(f"probe-holder-{kind}", api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    agent.register_memory([(address, NUM_BYTES, 0, "")], "VRAM")
    control.send({**found, "metadata": agent.get_agent_metadata(), "address": address})
    control.recv()


def probe(kind: str) -> dict:
    """One candidate, end to end; a failure anywhere is the candidate's answer, not the probe's end."""
    spawn = multiprocessing.get_context("spawn")
    owner_peer, holder_peer = spawn.Pipe()  # owner <-> holder: the share itself
    to_owner, owner_control = spawn.Pipe()
    to_holder, holder_control = spawn.Pipe()
    processes = [spawn.Process(target=owner, args=(kind, owner_peer, owner_control)),
                 spawn.Process(target=holder, args=(kind, holder_peer, holder_control))]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + BUDGET_S
        while not to_holder.poll(0.5):
            dead = [(role, p.exitcode) for role, p in zip(("owner", "holder"), processes) if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                why = f"the {dead[0][0]} exited ({dead[0][1]})" if dead else f"no answer in {BUDGET_S:g} s"
                return {"candidate": kind, "error": f"{why}: see its traceback on stderr"}
        found = to_holder.recv()
        result = {"candidate": kind, **{k: v for k, v in found.items() if k not in ("metadata", "address")}}
        result.update(_read(kind, found["metadata"], found["address"], deadline))
        if kind == "daemon_owned":
            left = max(deadline - time.monotonic(), 0.1)
            result.update(to_owner.recv() if to_owner.poll(left) else {"engine_imported": "no answer"})
        return result
    except Exception as err:  # noqa: BLE001
        return {"candidate": kind, "error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        for end in (to_holder, to_owner):
            try:
                end.send("done")
            except OSError:
                pass
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def _read(kind: str, metadata: bytes, address: int, deadline: float) -> dict:
    from kvxferd.xfer.nixl.nixl_module import nixl_api
    from kvxferd.xfer.nixl.ucxpaths import UcxLog, flush_c_streams
    lib = _context()
    api = nixl_api()[0]
    reader = api.nixl_agent(f"probe-reader-{kind}", api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    destination = ctypes.c_uint64()
    check_drv(lib.cuMemAlloc_v2(ctypes.byref(destination), ctypes.c_size_t(NUM_BYTES)), "cuMemAlloc", "probe")
    reader.register_memory([(destination.value, NUM_BYTES, 0, "")], "VRAM")
    remote = reader.add_remote_agent(metadata)
    local_descs = reader.get_xfer_descs([(destination.value, NUM_BYTES, 0)], "VRAM")
    remote_descs = reader.get_xfer_descs([(address, NUM_BYTES, 0)], "VRAM")
    times = []
    for _ in range(ROUNDS + 1):
        handle = reader.initialize_xfer("READ", local_descs, remote_descs, remote)
        start = time.perf_counter()
        reader.transfer(handle)
        while (state := reader.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                return {"read": f"no answer within the candidate's {BUDGET_S:g} s"}
        times.append(time.perf_counter() - start)
        reader.release_xfer_handle(handle)
        if state != "DONE":
            return {"read": state}
    seen = np.empty(NUM_BYTES, np.uint8)
    check_drv(lib.cuMemcpyDtoH_v2(seen.ctypes.data_as(ctypes.c_void_p), destination, ctypes.c_size_t(NUM_BYTES)),
              "cuMemcpyDtoH", "probe")
    flush_c_streams()
    paths = []
    if os.environ.get("UCX_LOG_FILE"):
        paths = sorted({s.path for _, s in UcxLog(os.environ["UCX_LOG_FILE"]).read()[0]
                        if s.worker == f"probe-reader-{kind}" and s.memory == "cuda<-cuda"})
    return {"read": "byte-exact" if np.array_equal(seen, pattern(NUM_BYTES)) else "bytes differ",
            "gbps": round(NUM_BYTES / statistics.median(times[1:]) / 1e9, 2), "ucx_path": paths or ["not reported"]}


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _context_bytes_child(conn) -> None:
    """In a fresh process: GPU 0's used bytes (NVML, which makes no context) before and after this process
    makes the CUDA context a daemon makes (primary context, one small allocation)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        device, memory = ctypes.c_void_p(), _NvmlMemory()
        nvml.nvmlInit_v2()
        nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device))
        nvml.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory))
        before = memory.used
        lib, pointer = _context(), ctypes.c_uint64()
        check_drv(lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(64)), "cuMemAlloc", "probe")
        nvml.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory))
        conn.send(memory.used - before)
    except Exception as err:  # noqa: BLE001
        conn.send(f"{type(err).__name__}: {err}"[:200])


def context_bytes() -> int | str:
    """What one CUDA context of a daemon costs on the GPU (bytes), or why it could not be told."""
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=_context_bytes_child, args=(child,))
    process.start()
    answer = parent.recv() if parent.poll(BUDGET_S) else "no answer"
    process.join(5)
    return answer


def verdict(result: dict) -> str:
    """One line per candidate: what works, and whether a NIC and UCX's lane can serve it."""
    if "error" in result:
        return f"{result['candidate']}: FAILED: {result['error']}"
    nic = "a NIC can register it by DMA-BUF" if result["dma_buf"] == "ok" else "no DMA-BUF export"
    again = "exportable again" if result["export_again"] == "ok" else "not exportable again"
    return (f"{result['candidate']}: read {result['read']} at {result.get('gbps', 0)} GB/s over "
            f"{'/'.join(result.get('ucx_path', []))}; {again}; {nic}")


def main() -> int:
    from kvxferd.rig.verify.gpu import cuda_missing
    missing = cuda_missing()
    if missing:
        print(f"memory-model probe: needs a CUDA GPU: {missing}", file=sys.stderr)
        return 2
    # UCX turns cuda_ipc GETs off on a host without NVLink; without this every candidate READs emulated (seen
    # on an H200, 2026-11-30) and the probe cannot tell them apart. As `kvxferd bench gpu` does; set it to keep yours.
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    print(f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={os.environ['UCX_CUDA_IPC_ENABLE_GET_ZCOPY']}")
    context = context_bytes()
    print("a daemon's CUDA context on GPU 0: " + (f"{context / 2**20:.0f} MiB (budget it next to vLLM's "
                                                   "gpu_memory_utilization)" if isinstance(context, int) else context))
    results = [probe(kind) for kind in CANDIDATES]
    for result in results:
        print(verdict(result))
    print(json.dumps(results), file=sys.stderr)
    return 0 if all("error" not in r and r.get("read") == "byte-exact" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
