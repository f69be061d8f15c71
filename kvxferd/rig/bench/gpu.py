"""``kvxferd bench gpu``: reads between GPU caches, through the daemons and over raw NIXL.

    kvxferd bench gpu [--quick] [--json]

Needs a CUDA GPU and a CUDA build of torch; without them it says so and
exits 2. One prefill daemon and two decode daemons run on this host: one
reads over NIXL (``--no-same-host-reads``), the other copies from the
prefill engine's allocation itself (issue #37: the holder hands it the
CUDA IPC handle, it batches device copies). Each engine's cache is one CUDA
allocation, shared with its daemons by a CUDA IPC handle (``VRAM``). The
prefill engine is a process of its own, as in production: CUDA opens an IPC
handle only in a process other than the one that made it. This process is
the decode engine (registered with both decode daemons), and the raw-NIXL
reader beside it::

    prefill engine process ── IPC ──► prefill daemon ◄── NIXL READ ── decode daemon (NIXL) ◄──── IPC ── this
                                 │           ▲                                                   process
                                 └ IPC ──────┼───── device copies ─ decode daemon (same-host) ◄─ IPC ─ (decode
                                             └───────────── NIXL READ, raw baseline ──────────────── engine)

Measured in one run:

* device copy: the GPU copying the bulk request's bytes within its own
  memory (torch, one contiguous copy): the floor of any transfer here;
* bulk: one large request, raw NIXL and both daemon paths alternating, the
  median of each; then the decode cache is reset, read once more through
  each daemon path, copied back and checked byte for byte against the oracle;
  the same-host path against the device copy is issue #37's target (>= 0.5);
* per request: small requests one after another, alternating the three
  paths: p50 and p99 of each and what the daemons add (the same-host path
  also over a device copy of the same bytes: target <= 500 us);
* own memory: raw NIXL again, but from a process that allocated the memory
  and registered it itself (no daemon, no CUDA IPC import): what UCX does
  when its cuda_ipc transport can serve the owner's memory.

UCX turns cuda_ipc GETs off on hosts without NVLink; the suite turns them on
(``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, for every process it starts) unless the
variable is set already, and prints the value it ran with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from kvxferd.rig.bench.common import bench_main, full_attention_groups, percentiles_us
from kvxferd.rig.bench.raw import RawReader, prepare_raw, read_all
from kvxferd.client import DaemonProcess, EngineClient
from kvxferd.plan.engine import EngineTransferPlan, ReadRequest
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.plan.groups import CacheGroup, EngineCache, RegionMemory
from kvxferd.rig.verify.buffers import verify_decode
from kvxferd.rig.verify.gpu import GpuEngine, cuda_missing
from kvxferd.rig.verify.process import EngineProcess
from kvxferd.xfer.nixl.agent import NixlAgent

FULL = dict(num_layers=32, num_blocks=256, rounds=4, small_blocks=2, num_small=100)
QUICK = dict(num_layers=8, num_blocks=64, rounds=3, small_blocks=2, num_small=60)
PREFILL_ID, DECODE_ID, OWNER_ID = "gpu-prefill", "gpu-decode", "gpu-owner"
GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
OWNER_POLL_S = 1e-3  # an emulated GET (UCX over TCP) needs the owner's progress


class GpuPrefill:
    """The prefill engine (in its own process): a tagged GPU cache registered with its daemon; holds on command."""

    def __init__(self, groups: tuple[CacheGroup, ...], engine_target: str) -> None:
        self.engine = GpuEngine.allocate(PREFILL_ID, groups, 1, 0, tagged=True)
        self.client = EngineClient(engine_target)
        self.client.register(self.engine.register_pb(), lease_s=60.0)

    def hold(self, request_id: str, block_ids: list[np.ndarray]) -> bytes:
        """Hold; the capability the read must carry."""
        return self.client.hold(request_id, block_ids).capability

    def close(self) -> None:
        self.client.close()


class GpuOwner:
    """A process that allocates a GPU cache and registers it with a NIXL agent of its own (no daemon)."""

    def __init__(self, groups: tuple[CacheGroup, ...]) -> None:
        self.engine = GpuEngine.allocate(OWNER_ID, groups, 1, 0, tagged=True)
        self.agent = NixlAgent(OWNER_ID)
        self.agent.register(self.engine.cache)
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._poll, name="owner-progress", daemon=True)
        self._progress.start()

    def _poll(self) -> None:
        while not self._stop.wait(OWNER_POLL_S):
            self.agent.poll_notifications()

    def info(self) -> tuple[bytes, list[list[tuple[int, int]]]]:
        """The agent's metadata and each region's (device address, bytes)."""
        return self.agent.metadata(), [[(r.address, r.num_bytes) for r in regions] for regions in self.engine.cache.memory]

    def close(self) -> None:
        self._stop.set()
        self._progress.join()
        self.agent.close()


def _own_memory_s(decode: GpuEngine, groups: tuple[CacheGroup, ...], request: ReadRequest, rounds: int) -> float:
    """Median seconds of raw NIXL reading ``request`` from a :class:`GpuOwner`'s own memory."""
    owner = EngineProcess("owner", groups, factory=GpuOwner)
    agent = None
    try:
        metadata, memory = owner.call("info")
        owner_cache = EngineCache(OWNER_ID, 1, 0, groups, tuple(tuple(RegionMemory(a, n, decode.tensor.device.index)
                                                                      for a, n in regions) for regions in memory),
                                  mem_type="VRAM")
        agent = NixlAgent("gpu-own-reader")
        agent.register(decode.cache)
        plan = EngineTransferPlan(decode.cache, [owner_cache])
        (read,) = plan.plan_request(request).reads
        local, remote, ids = prepare_raw(agent.raw, agent.add_remote(metadata), plan.rank_plans[0], read,
                                         mem_types=("VRAM", "VRAM"))
        try:
            times_s = [read_all([(agent.raw, local, remote, ids)]) for _ in range(rounds + 1)]
        finally:
            local.release()
            remote.release()
        return statistics.median(times_s[1:])
    finally:
        if agent is not None:
            agent.close()
        owner.close()


def _daemon_read(prefill: EngineProcess, client: EngineClient, request: ReadRequest) -> tuple[float, pb.Completion]:
    """Hold (untimed), then submit -> completion on the decode engine's Reads session: seconds, and the
    completion (where the daemon's time went)."""
    capability = prefill.call("hold", request.remote_request_id, list(request.remote_block_ids))
    start = time.perf_counter()
    client.reads.submit_reads([client.read_spec(request.request_id, PREFILL_ID, request.remote_request_id,
                                          request.local_block_ids, request.remote_block_ids,
                                          remote_capabilities=[capability])])
    completion = client.reads.wait_completion(request.request_id)
    elapsed = time.perf_counter() - start
    if not completion.ok:
        raise RuntimeError(f"daemon read {request.request_id} failed: {completion.error}")
    return elapsed, completion


def _device_copy_s(num_bytes: int, rounds: int) -> float:
    """Median seconds of one device-to-device copy of ``num_bytes`` (CUDA events)."""
    import torch

    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    times = []
    for _ in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


class _Pair:
    """The daemons, the prefill engine process, the decode engine (with both decode daemons) and the raw reader."""

    def __init__(self, workdir: str, groups: tuple[CacheGroup, ...]) -> None:
        quiet = ("--log-level", "WARNING")
        self.daemons = DaemonProcess.start_many(["gpu-p0", "gpu-d1"], socket_dir=workdir, extra_args=quiet)
        self.prefill = self.raw = None
        self.clients: list[EngineClient] = []
        try:
            self.daemons.append(DaemonProcess("gpu-d0", socket_dir=workdir,
                                              extra_args=(*quiet, "--no-same-host-reads")))
            self.prefill = EngineProcess("prefill", groups, self.daemons[0].engine_target, factory=GpuPrefill)
            self.decode = GpuEngine.allocate(DECODE_ID, groups, 1, 0, tagged=False)
            for daemon in (self.daemons[2], self.daemons[1]):  # clients[0]: over NIXL; clients[1]: same-host
                self.clients.append(EngineClient(daemon.engine_target))
                self.clients[-1].register(self.decode.register_pb(), lease_s=60.0)
                self.clients[-1].handshake(PREFILL_ID, [self.daemons[0].peer_address])
            self.raw = RawReader(self.decode.cache, PREFILL_ID, [self.daemons[0].peer_address], "raw-gpu-decode")
        except BaseException:
            self.close()
            raise

    def same_host_copies(self) -> tuple[float, float]:
        """Rank reads each decode daemon copied same-host: (over-NIXL daemon, same-host daemon)."""
        return tuple(d.metric("kvxferd_same_host_copies_total") for d in (self.daemons[2], self.daemons[1]))

    def close(self) -> None:
        for closer in (self.raw, *self.clients, self.prefill):
            if closer is not None:
                closer.close()
        for daemon in self.daemons:
            daemon.terminate()


def _alternate(pair: _Pair, requests: list[ReadRequest]) -> tuple[list[float], list[float], list, int, int]:
    """Raw NIXL, the daemons over NIXL, the same-host daemon, for each request: ``(raw seconds, daemon
    seconds, same-host (seconds, completion) pairs, bytes, descriptors)``."""
    prepared = pair.raw.prepare(requests[0])
    num_bytes = sum(p[3] for p in prepared)
    num_descriptors = sum(len(p[2]) for p in prepared)
    raw_s, daemon_s, same_host_s = [], [], []
    try:
        for request in requests:
            raw_s.append(pair.raw.read(prepared))
            daemon_s.append(_daemon_read(pair.prefill, pair.clients[0], request)[0])
            same_host_s.append(_daemon_read(pair.prefill, pair.clients[1], _renamed(request, "-s")))
    finally:
        pair.raw.release(prepared)
    return raw_s, daemon_s, same_host_s, num_bytes, num_descriptors


def same_host_split(reads: list[tuple[float, pb.Completion]]) -> dict[str, float]:
    """Medians (us) of where a same-host read's time went, from its completion: ``plan`` (submit to the
    data-plane thread), ``post`` (to every rank posted, plan included), ``transfer`` (the copies),
    ``check`` (the board checks and notices), and ``outside`` (the engine's leg: the submit reaching the
    daemon and the completion coming back, i.e. what the engine waited beyond the daemon's duration)."""
    def p50(values) -> float:
        return statistics.median(values) * 1e6
    return {"plan": p50([c.plan_s for _, c in reads]), "post": p50([c.post_s for _, c in reads]),
            "transfer": p50([c.transfer_s for _, c in reads]), "check": p50([c.check_s for _, c in reads]),
            "outside": p50([elapsed - c.duration_s for elapsed, c in reads])}


def _renamed(request: ReadRequest, suffix: str) -> ReadRequest:
    """The same blocks under new ids: a hold of its own on the prefill side."""
    return dataclasses.replace(request, request_id=request.request_id + suffix,
                               remote_request_id=request.remote_request_id + suffix)


def _checked(pair: _Pair, groups: tuple[CacheGroup, ...], client: EngineClient, request: ReadRequest) -> tuple:
    """Reset the decode cache, read ``request`` through ``client``'s daemon, check every byte."""
    pair.decode.reset()
    _daemon_read(pair.prefill, client, request)
    pair.decode.download()
    return verify_decode([pair.decode.host], groups, request)


def _requests(name: str, block_ids: np.ndarray, count: int) -> list[ReadRequest]:
    return [ReadRequest(f"{name}-{i}", f"{name}-{i}@p", (block_ids,), (block_ids,)) for i in range(count)]


def run(*, num_layers: int, num_blocks: int, rounds: int, small_blocks: int, num_small: int) -> dict:
    """Every figure of the suite, as a dict (see the module's docstring)."""
    import torch

    set_before = os.environ.get(GET_ZCOPY)
    get_zcopy = os.environ.setdefault(GET_ZCOPY, "y")  # inherited by the daemons and engine processes started below
    try:
        figures = _measure(num_layers, num_blocks, rounds, small_blocks, num_small)
    finally:
        if set_before is None:
            os.environ.pop(GET_ZCOPY, None)
    return {"device": torch.cuda.get_device_name(0), GET_ZCOPY: get_zcopy, **figures}


def _measure(num_layers: int, num_blocks: int, rounds: int, small_blocks: int, num_small: int) -> dict:
    groups = full_attention_groups(num_layers, num_blocks)
    with tempfile.TemporaryDirectory(prefix="kvxferd-bench-gpu-") as workdir:
        pair = _Pair(workdir, groups)
        try:
            # Round 0 of each path warms its connections up and is left out.
            raw_s, daemon_s, same_s, num_bytes, num_descriptors = _alternate(
                pair, _requests("bulk", np.arange(num_blocks), rounds + 1))
            # The reads above wrote the same bytes: check each daemon path's read on its own.
            checked = ReadRequest("checked", "checked@p", (np.arange(num_blocks),), (np.arange(num_blocks),))
            problems, wrong_bytes = _checked(pair, groups, pair.clients[0], checked)
            same_problems, same_wrong = _checked(pair, groups, pair.clients[1], _renamed(checked, "-s"))
            small = np.arange(small_blocks) * (num_blocks // small_blocks)  # scattered blocks
            small_raw_s, small_daemon_s, small_same_s, small_bytes, small_descriptors = _alternate(
                pair, _requests("small", small, num_small + 1))
            nixl_copies, same_copies = pair.same_host_copies()
            # The transport self-check's word (issue #56): UCX's paths for the NIXL daemon's READs, and
            # what the prefill daemon says a NIC can make of the engine's VRAM.
            transport = {"read_paths": pair.daemons[2].transport_paths(),
                         "vram_regions": pair.daemons[0].labelled("kvxferd_vram_regions", "kind")}
            own_s = _own_memory_s(pair.decode, groups, checked, rounds)
            device_s = _device_copy_s(num_bytes, rounds)
            small_device_s = _device_copy_s(small_bytes, rounds)
        finally:
            pair.close()
    same_s = [elapsed for elapsed, _ in same_s]
    small_split = same_host_split(small_same_s[1:])
    small_same_s = [elapsed for elapsed, _ in small_same_s]
    raw_bulk_s, daemon_bulk_s, same_bulk_s = (statistics.median(times[1:]) for times in (raw_s, daemon_s, same_s))
    raw_small, daemon_small, same_small = (percentiles_us(times[1:]) for times in (small_raw_s, small_daemon_s,
                                                                                    small_same_s))
    return {"bulk": {"bytes": num_bytes, "descriptors": num_descriptors, "rounds": rounds,
                     "device_copy_gbps": num_bytes / device_s / 1e9, "own_memory_gbps": num_bytes / own_s / 1e9,
                     "raw_gbps": num_bytes / raw_bulk_s / 1e9,
                     "daemon_gbps": num_bytes / daemon_bulk_s / 1e9, "ratio": raw_bulk_s / daemon_bulk_s,
                     "raw_ms": raw_bulk_s * 1e3, "daemon_ms": daemon_bulk_s * 1e3,
                     "same_host_gbps": num_bytes / same_bulk_s / 1e9, "same_host_ms": same_bulk_s * 1e3,
                     "same_host_vs_device_copy": device_s / same_bulk_s,
                     "byte_exact": not problems and wrong_bytes == 0, "wrong_bytes": wrong_bytes,
                     "problems": problems[:3],
                     "same_host_byte_exact": not same_problems and same_wrong == 0, "same_host_wrong_bytes": same_wrong,
                     "same_host_problems": same_problems[:3]},
            "per_request": {"bytes": small_bytes, "descriptors": small_descriptors, "requests": num_small,
                            "raw": raw_small, "daemon": daemon_small, "same_host": same_small,
                            "overhead_p50_us": daemon_small["p50_us"] - raw_small["p50_us"],
                            "device_copy_us": small_device_s * 1e6,
                            "same_host_added_p50_us": same_small["p50_us"] - small_device_s * 1e6,
                            "same_host_split_p50_us": small_split},
            # rank reads each decode daemon copied itself: 0 over NIXL; every read on the same-host daemon
            "same_host_copies": {"nixl_daemon": nixl_copies, "same_host_daemon": same_copies},
            "transport": transport}


# Through the daemons at under a tenth of what UCX gives an owner of its memory: not the per-request
# path (1-2 ms a read) but the transport: UCX emulating the READs over TCP (docs/benchmarks.md).
SLOW_TRANSPORT_FRACTION = 0.1


def transport_hint(bulk: dict) -> str:
    """A line that says why the daemons' reads are far slower than an owner's own (or "")."""
    if bulk["daemon_gbps"] >= SLOW_TRANSPORT_FRACTION * bulk["own_memory_gbps"]:
        return ""
    return (f"  note: the daemons read at {bulk['daemon_gbps'] / bulk['own_memory_gbps']:.2%} of the own-memory speed: "
            "most likely UCX's software path, as its cuda_ipc cannot serve memory a daemon imported "
            "(UCX_PROTO_INFO=y shows the path; docs/benchmarks.md, \"GPU caches on an H100\")")


def _exact(ok: bool, wrong_bytes: int, problems: list) -> str:
    return "byte-exact" if ok else f"WRONG: {wrong_bytes} bytes; {problems}"


def format_table(f: dict) -> str:
    """The figures as a few readable lines."""
    b, s = f["bulk"], f["per_request"]
    hint = transport_hint(b)
    lines = [
        f"GPU: {f['device']}; P1->D1 daemons, both caches on this GPU (CUDA IPC handles, NIXL VRAM); "
        f"{GET_ZCOPY}={f[GET_ZCOPY]}",
        f"bulk: {b['bytes'] / 2**20:.0f} MiB per request ({b['descriptors']} descriptors), median of {b['rounds']} "
        f"alternating rounds",
        f"  device copy {b['device_copy_gbps']:.1f} GB/s   raw NIXL {b['raw_gbps']:.1f} GB/s ({b['raw_ms']:.2f} ms)   "
        f"through daemons {b['daemon_gbps']:.1f} GB/s ({b['daemon_ms']:.2f} ms)   ratio {b['ratio']:.3f}",
        f"  raw NIXL from an owner's own memory (no daemon, no IPC import) {b['own_memory_gbps']:.1f} GB/s",
        *([hint] if hint else []),
        f"  checked read: {_exact(b['byte_exact'], b['wrong_bytes'], b['problems'])}"]
    if "same_host_gbps" in b:
        lines += [f"  same-host daemon (device copies) {b['same_host_gbps']:.1f} GB/s ({b['same_host_ms']:.2f} ms)   "
                  f"{b['same_host_vs_device_copy']:.2f}x the device copy (target >= 0.5)",
                  f"  same-host checked read: {_exact(b['same_host_byte_exact'], b['same_host_wrong_bytes'], b['same_host_problems'])}"]
    lines += [
        f"per request: {s['requests']} requests of {s['bytes'] / 2**10:.0f} KiB ({s['descriptors']} descriptors), "
        f"one at a time, alternating",
        f"  raw NIXL p50 {s['raw']['p50_us']:.0f} us, p99 {s['raw']['p99_us']:.0f} us;   "
        f"through daemons p50 {s['daemon']['p50_us']:.0f} us, p99 {s['daemon']['p99_us']:.0f} us;   "
        f"added at p50 {s['overhead_p50_us']:.0f} us"]
    if "same_host" in s:
        lines.append(f"  same-host daemon p50 {s['same_host']['p50_us']:.0f} us, p99 {s['same_host']['p99_us']:.0f} us;"
                     f"   a device copy of the bytes {s['device_copy_us']:.0f} us;   added at p50 "
                     f"{s['same_host_added_p50_us']:.0f} us (target <= 500)")
        if "same_host_split_p50_us" in s:
            t = s["same_host_split_p50_us"]
            lines.append(f"    where its time went (p50): post {t['post']:.0f} us (plan {t['plan']:.0f}), copies "
                         f"{t['transfer']:.0f}, board checks and notices {t['check']:.0f}, the engine's leg "
                         f"{t['outside']:.0f}")
    if "transport" in f:
        t = f["transport"]
        paths = ", ".join(f"{path} ({n} endpoint configurations)" for path, n in t["read_paths"].items())
        kinds = ", ".join(f"{kind} {n:.0f}" for kind, n in t["vram_regions"].items() if n)
        lines.append(f"transport self-check: the NIXL daemon's READs took {paths or 'no path UCX reported'}; "
                     f"prefill VRAM regions: {kinds or 'none'}")
    if "same_host_copies" in f:
        c = f["same_host_copies"]
        lines.append(f"rank reads copied same-host: {c['same_host_daemon']:.0f} by the same-host daemon, "
                     f"{c['nixl_daemon']:.0f} by the NIXL one")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller caches and fewer requests (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    """Exit 2 (one line) without a GPU; 1 when a checked read was not byte-exact; else 0."""
    missing = cuda_missing()
    if missing:
        print(f"kvxferd bench gpu: needs a CUDA GPU: {missing}", file=sys.stderr)
        return 2
    figures = run(**(QUICK if args.quick else FULL))
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0 if figures["bulk"]["byte_exact"] and figures["bulk"]["same_host_byte_exact"] else 1


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.gpu", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
