"""The connector's vLLM-free pieces: params, settings, cache description, transfer stats, and a hold -> read
cycle on real daemons; and (where vLLM is installed) vLLM carrying the stats to its metrics."""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvxferd.client import DaemonProcess
from kvxferd.client.session import Held
from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.integrations.vllm.describe import describe_engine, share_host_storages
from kvxferd.integrations.vllm.params import (ParamsError, RemotePrefill, failed_prefill_params, parse_remote_prefill,
                                              verify_of)
from kvxferd.integrations.vllm.scheduler import HeldRequest, RankDaemon, ReadOrder, SchedulerSide, real_blocks
from kvxferd.integrations.vllm.settings import ConnectorSettings, load_settings
from kvxferd.integrations.vllm.stats import TransferPromMetrics, TransferStats
from kvxferd.integrations.vllm.worker import WorkerSide
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base.config import DaemonConfig
from tests.integrations.connector_pair import connector_pair, eventually as _eventually, group, layer_cache

GOOD = RemotePrefill(kvxferd=1, remote_engine_id="p", remote_request_id="r-1", remote_peer_addresses=["127.0.0.1:1"],
                     remote_block_ids=[[4, 5]], remote_capabilities=["ab" * 16], remote_num_tokens=40,
                     remote_lease_expiry_unix_s=1.0).to_params()


@pytest.mark.parametrize("change, field", [
    ({"remote_block_ids": [[-1]]}, "remote_block_ids.0.0"),
    ({"remote_block_ids": []}, "remote_block_ids"),
    ({"remote_peer_addresses": []}, "remote_peer_addresses"),
    ({"remote_engine_id": "a b"}, "remote_engine_id"),
    ({"remote_num_tokens": 0}, "remote_num_tokens"),
    ({"remote_lease_expiry_unix_s": math.nan}, "remote_lease_expiry_unix_s"),
    ({"kvxferd": 2}, "kvxferd"),
    ({"remote_capabilities": ["AB" * 16]}, "remote_capabilities.0"),  # lower-case hex only
    ({"remote_capabilities": ["ab" * 15]}, "remote_capabilities.0"),
    ({"remote_capabilities": ["ab" * 16] * 2}, "remote_capabilities: Value error, 2 capabilities for 1"),
    ({"remote_request_id": None}, "remote_request_id"),
])
def test_bad_params_name_the_field(change, field):
    with pytest.raises(ParamsError) as err:
        parse_remote_prefill({**GOOD, **change})
    assert str(err.value).startswith(f"kv_transfer_params.{field}"), err.value


def test_params_round_trip_and_prefill_errors():
    assert parse_remote_prefill(GOOD).to_params() == GOOD
    with pytest.raises(ParamsError, match="could not hold"):
        parse_remote_prefill(failed_prefill_params("down"))
    with pytest.raises(ParamsError, match="expected an object"):
        parse_remote_prefill(["x"])


def test_settings_defaults_match_the_daemon_and_bad_options_are_named(monkeypatch):
    monkeypatch.delenv("KVXFERD_SOCKET_DIR", raising=False)
    assert load_settings({}).socket_for(0, 1) == DaemonConfig().engine_socket_path  # kvxferd serve's default
    with pytest.raises(ValueError, match="engine_socket"):
        load_settings({}).socket_for(1, 2)
    monkeypatch.setenv("KVXFERD_SOCKET_DIR", "/run/kvxferd")
    assert load_settings({}).socket_for(1, 2) == "/run/kvxferd/gpu1.sock"  # the Helm chart's sockets
    assert load_settings({"engine_socket": "/s/{rank}.sock"}).socket_for(3, 4) == "/s/3.sock"
    # Data-parallel ranks of one host: each rank its own GPU, so its own daemon.
    assert load_settings({}).socket_for(1, 2, dp_rank=1, dp_size=2) == "/run/kvxferd/gpu3.sock"
    assert load_settings({"engine_socket": "/s/{host_rank}.sock"}).socket_for(0, 1, 1, 2) == "/s/1.sock"
    assert load_settings({"engine_socket": "/s/{dp_rank}-{rank}.sock"}).socket_for(1, 2, 1, 2) == "/s/1-1.sock"
    with pytest.raises(ValueError, match="host_rank"):  # two GPUs, one daemon: refused
        load_settings({"engine_socket": "/s/{rank}.sock"}).socket_for(0, 1, 1, 2)
    with pytest.raises(ValueError, match="unknown field"):
        load_settings({"engine_socket": "/s/{gpu}.sock"}).socket_for(0, 1)
    monkeypatch.delenv("KVXFERD_SOCKET_DIR")
    with pytest.raises(ValueError, match="more than one rank"):
        load_settings({}).socket_for(0, 1, 0, 2)
    for bad in ("NHD", 1):
        with pytest.raises(ValueError, match="kv_cache_layout"):
            load_settings({"kv_cache_layout": bad})
    for bad, name in (({"lease_s": math.inf}, "lease_s"), ({"lease_s": -1}, "lease_s"), ({"colour": 1}, "colour")):
        with pytest.raises(ValueError, match=f"kv_connector_extra_config.{name}"):
            load_settings(bad)


def test_null_blocks_are_never_transferred():
    assert real_blocks(([0, 0, 7, 8], [3], [])) == ((7, 8), (3,), ())


def test_state_groups_stop_the_prefiller_one_token_short_and_decode_loads_that_much():
    """A running state (Mamba) holds the last prompt token once: prefill drops it, decode computes it."""
    attention, states = SchedulerSide("a", ConnectorSettings()), SchedulerSide("s", ConnectorSettings(), 1)
    prefill = {"do_remote_decode": True}
    assert [states.prompt_tokens_to_drop(prefill, n) for n in (1, 2, 40)] == [0, 1, 1]
    assert attention.prompt_tokens_to_drop(prefill, 40) == 0
    assert states.prompt_tokens_to_drop({**prefill, "kvxferd_prompt_cut": True}, 40) == 0  # preempted: cut once
    assert states.prompt_tokens_to_drop(None, 40) == states.prompt_tokens_to_drop(GOOD, 40) == 0  # not a prefill
    # decode: the remote 39 of a 40-token prompt; a one-token prompt loads nothing (decode computes it)
    assert states.matched_tokens("r", {**GOOD, "remote_num_tokens": 39}, 40, 0) == (39, True)
    # a state after fewer tokens is a start (decode computes the rest); after more it cannot be rewound
    assert states.matched_tokens("r", {**GOOD, "remote_num_tokens": 20}, 40, 0) == (20, True)
    assert states.matched_tokens("r", {**GOOD, "remote_num_tokens": 40}, 40, 0) == (0, False)
    assert states.matched_tokens("r", {**GOOD, "remote_num_tokens": 1}, 1, 0) == (0, False)
    assert attention.matched_tokens("r", GOOD, 40, 0) == (40, True)
    assert states.matched_tokens("r", {**GOOD, "error": "down"}, 40, 0) == (39, True)  # a failed load, same span
    assert states.matched_tokens("r", {**GOOD, "error": "down"}, 1, 0) == (1, True)  # vLLM must hear of it


def test_host_tensors_are_shared_in_place_and_described_per_layer():
    tensors = layer_cache()
    tensors["layer.1"][3, 1, 5, 7] = 2.5
    engine, fds = describe_engine("e", 0, 1, [group(tensors)], tensors)
    assert len(fds) == 1 and tensors["layer.1"].is_shared() and tensors["layer.1"][3, 1, 5, 7].item() == 2.5
    regions = engine.groups[0].regions
    assert [r.handle.shm_fd_index for r in regions] == [0, 0]
    assert [r.handle.offset for r in regions] == [0, tensors["layer.0"].numel() * 2]
    assert engine.mem_type == "DRAM" and engine.groups[0].attention.layout == "kv_per_head"
    _fds, placement = share_host_storages([tensors["layer.1"]])  # idempotent: already shared
    assert placement == [(0, regions[1].handle.offset)]


@pytest.mark.parametrize("vmm", [False, True], ids=["ipc", "vmm-fd"])
def test_cuda_tensors_are_described_by_ipc_handle_or_vmm_fd(vmm):
    """The CUDA path without a GPU: a meta tensor that reports a CUDA device stands in for vLLM's cache;
    memory CUDA IPC cannot share (vLLM's sleep mode: cuMemCreate) goes as a VMM fd beside host fds."""
    from kvxferd.client.gpu import GpuExport

    tensors = {"l0": torch.empty(16, 2, 32, 128, dtype=torch.bfloat16, device="meta")}
    calls = []

    def export(address, num_bytes):
        calls.append((address, num_bytes))
        return (GpuExport(4096, vmm_fd=77, allocation_bytes=1 << 21, rdma_capable=True) if vmm
                else GpuExport(4096, ipc_handle=b"h" * 64))

    fake = tensors["l0"]
    fake_device = type("D", (), {"type": "cuda", "index": 1})()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(fake), "device", property(lambda self: fake_device))
        engine, fds = describe_engine("e", 0, 1, [group(["l0"])], tensors, export_gpu=export,
                                      device_uuid=lambda index: f"GPU-{index}")  # any string: the daemon checks it
    region = engine.groups[0].regions[0]
    assert engine.mem_type == "VRAM" and calls == [(fake.data_ptr(), fake.numel() * 2)]
    assert (region.handle.offset, region.device_id) == (4096, 1)
    assert region.device_uuid == "GPU-1"  # the daemon finds the GPU by UUID, not by index
    if vmm:
        assert fds == [77] and region.handle.WhichOneof("source") == "cuda_vmm_fd_index"
        assert (region.handle.cuda_vmm_fd_index, region.handle.allocation_bytes) == (0, 1 << 21)
        assert region.handle.rdma_capable  # the engine's word: the daemon cannot read the flag itself
    else:
        assert fds == [] and region.handle.cuda_ipc_handle == b"h" * 64


def test_a_missing_daemon_is_a_clear_error_naming_the_socket(tmp_path):
    worker = WorkerSide("e", 0, 1, ConnectorSettings(engine_socket=str(tmp_path / "none.sock")))
    with pytest.raises(RuntimeError, match="none.sock"):
        worker.register([group(["layer.0"])], layer_cache(layers=1))


def test_the_scheduler_sends_every_ranks_hold_before_it_waits_for_one():
    """The order of calls, with clients that record it: every hold is sent, then the answers are read (a hold
    one rank after another would interleave them)."""
    calls = []

    class Client:
        def __init__(self, q):
            self.q = q

        def hold_started(self, request_id, block_ids, *, lease_s=0.0, push_key_digest=b"", layers_final=(),
                         want_digests=False, traceparent=""):
            calls.append(("sent", self.q))
            return lambda: calls.append(("answered", self.q)) or Held(f"inc{self.q}", bytes([self.q]) * 16)

        def hold(self, request_id, block_ids, *, lease_s=0.0):
            return self.hold_started(request_id, block_ids, lease_s=lease_s)()

    scheduler = SchedulerSide("order", ConnectorSettings(engine_socket="unused"))
    scheduler.set_ranks([RankDaemon(q, f"s{q}", f"127.0.0.1:{q + 1}") for q in range(4)])
    scheduler._client = lambda rank: Client(rank.tp_rank)
    delay, params = scheduler.hold("r", ([1, 2],), 64)
    assert delay and params["remote_capabilities"] == [bytes([q]).hex() * 16 for q in range(4)]
    assert calls == [("sent", q) for q in range(4)] + [("answered", q) for q in range(4)]


def test_a_tp_prefill_holds_on_every_rank_at_once_or_on_none(tmp_path):
    """The scheduler sends every rank's hold before it waits for any (issue #41: one round trip, not one
    per rank); a rank that refuses makes the others' holds go (all or none), and the error names it."""
    daemons = DaemonProcess.start_many(["hp0", "hp1"], socket_dir=str(tmp_path))
    workers = []
    try:
        cache = layer_cache()
        workers = [WorkerSide("hp", q, 2, ConnectorSettings(engine_socket=daemons[q].socket)) for q in range(2)]
        ranks = [worker.register([group(cache)], cache) for worker in workers]
        scheduler = SchedulerSide("hp", workers[0].settings)
        scheduler.set_ranks(ranks)
        delay, params = scheduler.hold("both", ([3, 4],), 64)
        assert delay and len(params["remote_capabilities"]) == 2 and params["remote_peer_addresses"] == [
            r.peer_address for r in ranks]
        # rank 1's daemon no longer knows the engine: rank 1 refuses, and rank 0's hold is released
        workers[1].client.deregister()
        delay, params = scheduler.hold("one", ([5, 6],), 64)
        assert not delay and params["error"].startswith(f"rank 1 ({daemons[1].socket}): "), params
        workers[0].client.hold("one", [[5, 6]])  # free to hold again: the failed attempt left nothing held
    finally:
        for worker in workers:
            worker.close()
        for daemon in daemons:
            daemon.terminate()


def test_hold_order_read_cycle_on_real_daemons(tmp_path):
    """Prefill worker + scheduler hold, decode scheduler orders, decode worker reads: byte-exact."""
    with connector_pair(tmp_path, ("ip0", "id0")) as pair:
        daemons, prefill, decode, ranks, prefill_cache, decode_cache = pair
        prefill_scheduler, decode_scheduler = SchedulerSide("p", prefill.settings), SchedulerSide("d", decode.settings)
        prefill_scheduler.set_ranks(ranks)
        delay, params = prefill_scheduler.hold("req", ([0, 3, 4, 5],), 100)  # 0 is vLLM's null block
        assert delay and params["remote_block_ids"] == [[3, 4, 5]] and params["remote_peer_addresses"] == [ranks[0].peer_address]
        prefill.expect_held(prefill_scheduler.take_held())
        assert decode_scheduler.matched_tokens("dreq", params, 100, 32) == (68, True)  # one block cached locally
        decode_scheduler.after_alloc("dreq", params, [[9, 10]], 68)
        decode.submit(decode_scheduler.take_orders())
        deadline, received, sent = time.monotonic() + 20, set(), set()
        while (not received or not sent) and time.monotonic() < deadline:
            time.sleep(0.02)
            got, held = decode.results(), prefill.results()
            assert not got.failed_recving and not got.invalid_block_ids
            received |= got.finished_recving
            sent |= held.finished_sending
        assert (received, sent) == ({"dreq"}, {"req"})
        read = decode.take_stats()  # one read of two blocks in each of two layers; the daemon counted the same bytes
        block_bytes = decode_cache["layer.0"][0].nbytes
        assert (read.data["num_transfers"], read.num_failed_transfers) == (1, 0), read
        assert read.data["transferred_bytes"] == 2 * 2 * block_bytes, read
        assert _eventually(lambda: daemons[1].metric("kvxferd_read_bytes_total")) == read.data["transferred_bytes"]
        assert decode.take_stats() is None  # taken: recording starts over
        assert prefill.take_stats().data["num_holds_ended"] == {"consumed": 1, "expired": 0}
        for name in prefill_cache:  # remote blocks 4, 5 landed in local blocks 9, 10; nothing else moved
            assert torch.equal(decode_cache[name][9:11], prefill_cache[name][4:6])
            assert decode_cache[name][:9].abs().sum() == 0 and decode_cache[name][11:].abs().sum() == 0
        # A full local hit reads nothing, yet its empty read still ends the prefill hold (CONSUMED);
        # vLLM is not waiting for that read, so it hears nothing of it and it is no transfer.
        delay, params = prefill_scheduler.hold("req2", ([6, 7],), 64)
        prefill.expect_held(prefill_scheduler.take_held())
        assert decode_scheduler.matched_tokens("dreq2", params, 64, 64) == (0, False)
        decode_scheduler.after_alloc("dreq2", params, [[]], 0)
        (order,) = decode_scheduler.take_orders()
        assert order.local_block_ids == ((),) and not order.awaited
        decode.submit([order])
        deadline, received, sent = time.monotonic() + 20, set(), set()
        while not sent and time.monotonic() < deadline:
            time.sleep(0.02)
            got = decode.results()
            assert not got.failed_recving
            received |= got.finished_recving
            sent |= prefill.results().finished_sending
        assert (received, sent) == (set(), {"req2"})
        assert decode.take_stats() is None
        assert prefill.take_stats().data["num_holds_ended"] == {"consumed": 1, "expired": 0}
        # A request whose params are bad fails alone, without an exception.
        decode_scheduler.matched_tokens("bad", {"do_remote_prefill": True}, 50, 0)
        decode_scheduler.after_alloc("bad", {"do_remote_prefill": True}, [[1, 2]], 50)
        decode.submit(decode_scheduler.take_orders())
        result = decode.results()
        assert result.failed_recving == {"bad"} and result.finished_recving == {"bad"}
        failed = decode.take_stats()
        assert failed.data["num_failed"]["not_submitted"] == 1 and failed.data["transferred_bytes"] == 0, failed


def test_a_verified_read_checks_the_kv_against_the_holds_digests_on_real_daemons(tmp_path):
    """Issue #59 through the connector: a prefill leg asking for it (kvxferd_verify) carries every rank's
    digests to decode, whose read is checked. A block changed in prefill's cache after the hold fails the
    read with that block invalid; without the check the same change reaches decode (the byte compare)."""
    with connector_pair(tmp_path, ("vp0", "vd0")) as pair:
        daemons, prefill, decode, ranks, prefill_cache, decode_cache = pair
        prefill_scheduler, decode_scheduler = SchedulerSide("p", prefill.settings), SchedulerSide("d", decode.settings)
        prefill_scheduler.set_ranks(ranks)
        outcomes = {}
        for verify, request in ((True, "clean"), (True, "damaged"), (False, "unchecked")):
            delay, params = prefill_scheduler.hold(request, ([3, 4],), 64, {"kvxferd_verify": verify})
            assert delay and len(params["remote_digests"]) == (1 if verify else 0), params
            prefill.expect_held(prefill_scheduler.take_held())
            if request != "clean":
                for name in prefill_cache:  # after the hold: an engine writing into a held block
                    prefill_cache[name][4].view(-1)[7] += 1.0
            decode_cache_before = {name: t.clone() for name, t in decode_cache.items()}
            decode_scheduler.matched_tokens("d" + request, params, 64, 0)
            decode_scheduler.after_alloc("d" + request, params, [[9, 10]], 64)
            decode.submit(decode_scheduler.take_orders())
            merged = _gather([decode], lambda m: "d" + request in m[decode]["recv"])
            outcomes[request] = (merged[decode]["failed"], merged[decode]["invalid"],
                                 all(torch.equal(decode_cache[name][9:11], prefill_cache[name][3:5]) for name in prefill_cache))
            for name, before in decode_cache_before.items():
                decode_cache[name].copy_(before)
            for name in prefill_cache:
                prefill_cache[name][4].view(-1)[7] -= 1.0 if request != "clean" else 0.0
        assert outcomes["clean"] == (set(), set(), True)
        assert outcomes["damaged"][:2] == (set(), {10})  # failed: only the changed block is invalid (vLLM's policy)
        assert outcomes["unchecked"] == (set(), set(), True)  # (the change was read along: the bytes match it)
        assert _eventually(lambda: daemons[1].metric("kvxferd_read_failures_total", 'kind="corrupt"')) == 1


def test_verify_params_are_checked_and_the_share_decides_the_rest():
    with pytest.raises(ParamsError, match="kvxferd_verify"):
        verify_of({"kvxferd_verify": "yes"})
    assert verify_of({}) is None and verify_of({"kvxferd_verify": False}) is False
    with pytest.raises(ParamsError, match="remote_digests"):
        parse_remote_prefill({**GOOD, "remote_digests": ["S0QB", "S0QB"]})  # two ranks' for one
    with pytest.raises(ParamsError, match="remote_digests"):
        parse_remote_prefill({**GOOD, "remote_digests": ["not base64!"]})
    assert parse_remote_prefill({**GOOD, "remote_digests": ["S0QB"]}).digests() == [b"KD\x01"]
    with pytest.raises(Exception):
        ConnectorSettings(engine_socket="x", verify_share=1.5)


def _gather(workers, until, timeout_s: float = 20.0, daemons=()) -> dict:
    """Merge each worker's results until ``until(merged)``; merged: worker -> field -> ids. A timeout names
    what came, and the end of each of ``daemons``' logs (what CI shows of a failure)."""
    merged = {w: {"recv": set(), "failed": set(), "sent": set(), "invalid": set()} for w in workers}
    deadline = time.monotonic() + timeout_s
    while not until(merged):
        assert time.monotonic() < deadline, "\n".join([f"not done in {timeout_s} s: {merged}",
                                                        *(f"{d.daemon_id}: {d.tail(1500)}" for d in daemons)])
        time.sleep(0.05)
        for worker in workers:
            got = worker.results()
            merged[worker]["recv"] |= got.finished_recving
            merged[worker]["failed"] |= got.failed_recving
            merged[worker]["sent"] |= got.finished_sending
            merged[worker]["invalid"] |= got.invalid_block_ids
    return merged


# No peer probe within the test: the decode daemon learns of the prefill restart from a failed read.
NO_PROBES = ("--peer-check-s", "600")


def _restart(daemons, index: int, tmp_path, while_down=lambda: None) -> None:
    """Kill daemon ``index``, call ``while_down()``, start it again on the same socket and peer port."""
    old = daemons[index]
    old.kill()
    while_down()
    daemons[index] = DaemonProcess(old.daemon_id, socket_dir=str(tmp_path), extra_args=(*old.port_args(("peer",)), *NO_PROBES))


def test_reshare_after_a_daemon_restart_fails_what_it_lost_and_the_worker_goes_on(tmp_path):
    """Host memory: the heartbeat passes the fds again and registers again. Decode: a read the old
    daemon had is a failed load, never a hang, and the next read handshakes anew and is byte-exact.
    Prefill: holds of the old registration end (their blocks may go); the first read after it, on
    the decode daemon's link to the old daemon, names its blocks invalid (vLLM recomputes them);
    the scheduler's later holds work (the new registration kept the session) and are read
    byte-exact."""
    daemons = DaemonProcess.start_many(["rp0", "rd0"], socket_dir=str(tmp_path), extra_args=NO_PROBES)
    workers = []
    try:
        prefill_cache, decode_cache = layer_cache(), layer_cache()
        for tensor in prefill_cache.values():
            tensor.copy_(torch.randn_like(tensor, dtype=torch.float32).to(torch.bfloat16))
        settings = [ConnectorSettings(engine_socket=d.socket, heartbeat_s=0.2) for d in daemons]
        prefill, decode = WorkerSide("p", 0, 1, settings[0]), WorkerSide("d", 0, 1, settings[1])
        workers = [prefill, decode]
        ranks = [prefill.register([group(prefill_cache)], prefill_cache)]
        decode.register([group(decode_cache)], decode_cache)
        prefill_scheduler, decode_scheduler = SchedulerSide("p", settings[0]), SchedulerSide("d", settings[1])
        prefill_scheduler.set_ranks(ranks)

        def order(request_id: str, remote_blocks, local_blocks):
            delay, params = prefill_scheduler.hold(request_id, (remote_blocks,), 32 * len(remote_blocks))
            assert delay, params
            prefill.expect_held(prefill_scheduler.take_held())
            decode_scheduler.matched_tokens(f"d-{request_id}", params, 32 * len(remote_blocks), 0)
            decode_scheduler.after_alloc(f"d-{request_id}", params, [local_blocks], 32 * len(remote_blocks))
            return decode_scheduler.take_orders()

        decode.submit(order("first", [1, 2], [1, 2]))  # handshakes with the prefill engine
        merged = _gather([decode], lambda m: "d-first" in m[decode]["recv"], daemons=daemons)
        assert merged[decode]["recv"] == {"d-first"} and not merged[decode]["failed"]
        assert isinstance(decode.client.reads._stream, ReadsSocketStream)  # the worker's reads skip gRPC
        lost = order("lost", [3], [3])
        _restart(daemons, 1, tmp_path, lambda: decode.submit(lost))  # the decode daemon: the read goes nowhere
        # The heartbeat registers again on its own; the lost read fails meanwhile or after.
        merged = _gather([decode], lambda m: "d-lost" in m[decode]["recv"] and decode.client.num_reregistrations,
                         daemons=daemons)
        assert merged[decode]["failed"] == {"d-lost"} and decode.client.num_reregistrations == 1, \
            (merged, decode.client.num_reregistrations)
        after = order("after", [4, 5], [9, 10])
        decode.submit(after)
        merged = _gather([decode, prefill], lambda m: "d-after" in m[decode]["recv"] and "after" in m[prefill]["sent"],
                         daemons=daemons)
        assert merged[decode]["recv"] == {"d-after"} and not merged[decode]["failed"], merged
        assert isinstance(decode.client.reads._stream, ReadsSocketStream)  # a new session on the new daemon's socket
        for name in prefill_cache:
            assert torch.equal(decode_cache[name][9:11], prefill_cache[name][4:6])
        assert "lost" not in merged[prefill]["sent"]  # still held: that daemon did not restart

        _restart(daemons, 0, tmp_path)  # the prefill daemon, with "lost" still held there
        merged = _gather([prefill], lambda m: "lost" in m[prefill]["sent"], daemons=daemons)
        assert merged[prefill]["sent"] == {"lost"} and prefill.client.num_reregistrations == 1, \
            (merged, prefill.client.num_reregistrations)
        # The new registration kept the session the scheduler holds with: holds and reads go on. No probe
        # has seen the restart yet, and the read's capability names the new daemon's hold key: the decode
        # daemon refuses it (nothing written: vLLM fails that load) and probes the link at once, which
        # finds the new incarnation and re-handshakes; the next read is byte-exact. ("later" stays held
        # until its lease runs out.)
        decode.submit(order("later", [6, 7], [12, 13]))
        merged = _gather([decode], lambda m: "d-later" in m[decode]["recv"], daemons=daemons)
        assert merged[decode]["failed"] == {"d-later"}, merged
        assert all(not torch.equal(decode_cache[name][12:14], prefill_cache[name][6:8]) for name in prefill_cache)
        time.sleep(1.0)  # the probe and its re-handshake
        decode.submit(order("later-again", [6, 7], [12, 13]))
        merged = _gather([decode, prefill], lambda m: "d-later-again" in m[decode]["recv"]
                         and "later-again" in m[prefill]["sent"], daemons=daemons)
        assert merged[decode]["recv"] == {"d-later-again"}, merged
        assert not merged[decode]["failed"] and not merged[decode]["invalid"], merged
        for name in prefill_cache:
            assert torch.equal(decode_cache[name][12:14], prefill_cache[name][6:8])
        # Five reads vLLM waited for; "lost" and "later" failed, and only the three ok ones count bytes.
        stats = decode.take_stats()
        assert stats.data["num_transfers"] == 5 and stats.num_failed_transfers == 2, stats.data
        assert stats.data["transferred_bytes"] == 3 * 2 * 2 * decode_cache["layer.0"][0].nbytes, stats.data
    finally:
        for worker in workers:
            worker.close()
        for daemon in daemons:
            daemon.terminate()


class _QuietClient:
    """What WorkerSide.results reads of its client, with nothing new."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation, self.incarnations = incarnation, [incarnation]
        self.reads = self  # the session's calls (take_lost, take_completions_timed, submit_reads) on the same fake

    def registered_again(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self.incarnations.append(incarnation)

    def take_lost(self) -> set[str]:
        return set()

    def take_completions_timed(self) -> list:
        return []


class _QuietSubscriber:
    def poll(self) -> list:
        return []


def test_only_holds_of_a_replaced_registration_end_with_it():
    """Matched by the incarnation each Hold answered: a hold the scheduler made on the new
    registration (even one the worker hears of after the change) is never let go early."""
    worker = WorkerSide("p", 1, 2, ConnectorSettings(engine_socket="/nonexistent/p.sock"))
    worker.client, worker.subscriber, worker._incarnation = _QuietClient("i1"), _QuietSubscriber(), "i1"
    worker.expect_held([HeldRequest("old", ("x", "i1"))])  # this worker is rank 1
    assert worker.results().finished_sending == set()
    worker.client.registered_again("i2")  # the daemon restarted; the heartbeat registered again
    worker.expect_held([HeldRequest("new", ("x", "i2")), HeldRequest("late-old", ("x", "i1"))])
    assert worker.results().finished_sending == {"old", "late-old"}
    assert worker.results().finished_sending == set()  # "new" waits for its CONSUMED / EXPIRED
    worker.client.registered_again("i3")  # twice between two polls: both earlier ones are gone
    worker.client.registered_again("i4")
    worker.expect_held([HeldRequest("newer", ("x", "i3")), HeldRequest("newest", ("x", "i4"))])
    assert worker.results().finished_sending == {"new", "newer"}


# ---- transfer stats (stats.py) and vLLM carrying them ---------------------------------------

def _two_workers() -> tuple[TransferStats, TransferStats]:
    """Two TP ranks' stats of one interval."""
    rank0, rank1 = TransferStats(), TransferStats()
    rank0.record_read(1000, transfer_s=0.002, wait_s=0.010)
    rank0.record_read(3000, transfer_s=0.004, wait_s=0.020)
    rank0.record_failed_read("read", wait_s=0.030)
    rank0.record_hold_ended("consumed")
    rank1.record_read(500, transfer_s=0.001, wait_s=0.005)
    rank1.record_failed_read("lost")
    rank1.record_hold_ended("expired")
    return rank0, rank1


def test_transfer_stats_record_aggregate_reduce_and_reset():
    rank0, rank1 = _two_workers()
    summed = TransferStats(rank0.to_dict()).aggregate(rank1)  # from a payload: a copy, rank0 is untouched
    assert rank0.data["num_transfers"] == 3 and rank0.data["transferred_bytes"] == 4000
    data = summed.data
    assert (data["num_transfers"], data["transferred_bytes"], summed.num_failed_transfers) == (5, 4500, 2)
    assert data["num_failed"] == {"read": 1, "refused": 0, "not_submitted": 0, "lost": 1}
    assert data["num_holds_ended"] == {"consumed": 1, "expired": 1}
    assert data["transfer_s"] == [0.002, 0.004, 0.001] and data["wait_s"] == [0.010, 0.020, 0.030, 0.005]
    assert summed.reduce() == {
        "num_transfers": 5, "num_failed_transfers": 2, "transferred_MB": round(4500 / 2**20, 3),
        "avg_transfer_ms": pytest.approx(2.333), "p90_transfer_ms": pytest.approx(3.6),
        "throughput_MB_per_s": pytest.approx(round(4500 / 2**20 / 0.007, 3)), "avg_wait_ms": pytest.approx(16.25),
        "num_holds_consumed": 1, "num_holds_expired": 1}
    taken = summed.clone_and_reset()
    assert summed.is_empty() and summed.data["transfer_s"] == [] and taken.data["transferred_bytes"] == 4500
    holds_only = TransferStats()
    holds_only.record_hold_ended("expired")
    assert not holds_only.is_empty()  # an interval of expiries alone is still reported
    assert TransferStats().reduce()["avg_transfer_ms"] == 0.0
    with pytest.raises(ValueError, match="timeout"):
        rank0.record_failed_read("timeout")  # labels stay bounded


def _fresh_metric_types(registry: CollectorRegistry) -> dict[type, object]:
    """What vLLM passes build_prom_metrics, registering into ``registry`` instead of the global one."""
    return {kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}


def _sample(registry: CollectorRegistry, name: str, engine: str = "0", **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": engine, **labels})


def test_transfer_prom_metrics_count_into_a_fresh_registry():
    registry = CollectorRegistry()
    prom = TransferPromMetrics(None, _fresh_metric_types(registry), ["model_name", "engine"],
                               {0: ["tiny", "0"], 1: ["tiny", "1"]})
    rank0, rank1 = _two_workers()
    prom.observe(rank0.aggregate(rank1).to_dict(), engine_idx=1)
    failed_only = TransferStats()
    failed_only.record_failed_read("refused")  # a failed read: a failure and a transfer, no bytes, no time
    prom.observe(failed_only.to_dict(), engine_idx=1)
    assert _sample(registry, "vllm:kvxferd_num_transfers_total", "1") == 6
    assert _sample(registry, "vllm:kvxferd_transferred_bytes_total", "1") == 4500
    assert [_sample(registry, "vllm:kvxferd_num_failed_transfers_total", "1", reason=r)
            for r in ("read", "refused", "not_submitted", "lost")] == [1, 1, 0, 1]
    assert _sample(registry, "vllm:kvxferd_transfer_time_seconds_count", "1") == 3
    assert _sample(registry, "vllm:kvxferd_transfer_time_seconds_sum", "1") == pytest.approx(0.007)
    assert _sample(registry, "vllm:kvxferd_transfer_time_seconds_bucket", "1", le="0.0025") == 2
    assert _sample(registry, "vllm:kvxferd_wait_time_seconds_count", "1") == 4
    assert _sample(registry, "vllm:kvxferd_num_holds_ended_total", "1", how="expired") == 1
    assert _sample(registry, "vllm:kvxferd_num_transfers_total", "0") == 0  # the other engine saw nothing


def test_vllm_carries_the_stats_from_workers_to_its_metrics_and_log():
    """vLLM's own path: its TP output aggregator sums the ranks' stats, the payload crosses its msgpack
    encoder, and its KVConnectorProm / KVConnectorLogging resolve the connector's classes."""
    pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (scripts/bootstrap.sh --vllm)")
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    transfer = KVTransferConfig(kv_connector="KvxferdConnector", kv_connector_module_path="kvxferd.integrations.vllm",
                                kv_role="kv_both", engine_id="d")
    rank0, rank1 = _two_workers()
    outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))
               for stats in (rank0, None, rank1)]  # a rank with nothing to report sends None
    merged = KVOutputAggregator(expected_finished_count=3).aggregate(outputs).kv_connector_output.kv_connector_stats
    payload = MsgpackDecoder().decode(MsgpackEncoder().encode(merged.to_dict()))  # as SchedulerStats carries it

    registry = CollectorRegistry()
    fresh = _fresh_metric_types(registry)

    class FreshProm(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = fresh[Gauge], fresh[Counter], fresh[Histogram]

    prom = FreshProm(VllmConfig(kv_transfer_config=transfer), ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(payload, 0)
    assert _sample(registry, "vllm:kvxferd_num_transfers_total") == 5
    assert _sample(registry, "vllm:kvxferd_transferred_bytes_total") == 4500
    assert _sample(registry, "vllm:kvxferd_num_failed_transfers_total", reason="lost") == 1

    logging_ = KVConnectorLogging(transfer)
    logging_.observe(payload)
    logging_.observe(payload)  # a second step of the same log interval
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "num_transfers=10," in lines[0] and "num_holds_expired=2" in lines[0], lines
    assert prom.prom_metrics is not None and payload["num_transfers"] == 5  # logging added into its own copy


class _ScriptedClient(_QuietClient):
    """What WorkerSide.submit / results use of its client, with completions and lost reads the test sets."""

    def __init__(self) -> None:
        super().__init__("i1")
        self.completions: list[pb.Completion] = []
        self.lost: set[str] = set()

    def handshake(self, remote_engine_id, peer_addresses) -> None:
        return None

    @staticmethod
    def read_spec(request_id, *args, **kwargs) -> str:
        return request_id

    def submit_reads(self, specs) -> None:
        return None

    def take_lost(self) -> set[str]:
        lost, self.lost = self.lost, set()
        return lost

    def take_completions_timed(self) -> list:
        completions, self.completions = self.completions, []
        return [(completion, 0.0) for completion in completions]


class _ScriptedSubscriber:
    def __init__(self, events) -> None:
        self.events = list(events)

    def poll(self) -> list:
        events, self.events = self.events, []
        return events


def test_the_worker_records_each_read_vllm_waited_for_once():
    worker = WorkerSide("d", 0, 1, ConnectorSettings(engine_socket="/nonexistent/d.sock"))
    kinds = pb.NotifyEvent
    worker.client, worker._incarnation, worker.num_groups = _ScriptedClient(), "i1", 1
    worker.subscriber = _ScriptedSubscriber([pb.NotifyEvent(request_id="h1", kind=kinds.CONSUMED),
                                             pb.NotifyEvent(request_id="h2", kind=kinds.EXPIRED),
                                             pb.NotifyEvent(request_id="h3", kind=kinds.FAILED)])  # not an end
    worker.submit([*(ReadOrder(r, GOOD, ((7, 8),)) for r in ("ok", "failed", "refused", "lost")),
                   ReadOrder("bad", None, (), "kv_transfer_params: bad"),
                   ReadOrder("unawaited", GOOD, ((),), awaited=False)])
    worker.client.completions = [
        pb.Completion(request_id="ok", ok=True, num_bytes=4096, duration_s=0.003),
        pb.Completion(request_id="failed", ok=False, num_bytes=2048, duration_s=0.5, error="deadline",
                      invalid_block_ids=[pb.BlockIds(ids=[8])]),  # half written: no bytes count
        pb.Completion(request_id="refused", ok=False, refused_code=9, error="refused"),
        pb.Completion(request_id="unawaited", ok=True, num_bytes=64),  # vLLM did not wait: no transfer
        pb.Completion(request_id="ok", ok=True, num_bytes=4096)]  # again (a resent read): counted once
    worker.client.lost = {"lost", "never-submitted"}
    result = worker.results()
    assert result.finished_recving == {"ok", "failed", "refused", "lost", "bad"}, result
    data = worker.take_stats().data
    assert (data["num_transfers"], data["transferred_bytes"], data["transfer_s"]) == (5, 4096, [0.003]), data
    assert data["num_failed"] == {"read": 1, "refused": 1, "not_submitted": 1, "lost": 1}, data
    assert len(data["wait_s"]) == 4 and all(0 <= s < 5 for s in data["wait_s"]), data  # not "bad": never submitted
    assert data["num_holds_ended"] == {"consumed": 1, "expired": 1}, data
    assert worker.results().finished_recving == set() and worker.take_stats() is None
