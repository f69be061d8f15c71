"""``kvxferd bench gpu`` where there is no GPU (one clear line, exit 2), and its table (tests/gpu runs it on a GPU)."""

import subprocess
import sys

import pytest

from kvxferd.rig.verify.gpu import cuda_missing


@pytest.mark.skipif(not cuda_missing(), reason="this machine has a GPU: tests/gpu runs the benchmark")
def test_bench_gpu_without_a_gpu_says_why_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "gpu", "--quick"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.startswith("kvxferd bench gpu: needs a CUDA GPU: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _figures(daemon_gbps: float, own_gbps: float) -> dict:
    bulk = {"bytes": 1 << 29, "descriptors": 8192, "rounds": 4, "device_copy_gbps": 1300.0, "own_memory_gbps": own_gbps,
            "raw_gbps": daemon_gbps, "daemon_gbps": daemon_gbps, "ratio": 1.0, "raw_ms": 1.0, "daemon_ms": 1.0,
            "byte_exact": True, "wrong_bytes": 0, "problems": []}
    small = {"bytes": 1 << 22, "descriptors": 64, "requests": 100, "raw": {"p50_us": 10.0, "p99_us": 20.0},
             "daemon": {"p50_us": 12.0, "p99_us": 25.0}, "overhead_p50_us": 2.0}
    return {"device": "a GPU", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "bulk": bulk, "per_request": small}


@pytest.mark.parametrize("daemon_gbps,own_gbps,hinted", [(0.4, 1074.0, True), (900.0, 1074.0, False),
                                                         (0.4, 0.4, False)])
def test_the_table_says_why_when_the_daemons_read_far_slower_than_an_owner(daemon_gbps, own_gbps, hinted):
    from kvxferd.rig.bench.gpu import format_table

    table = format_table(_figures(daemon_gbps, own_gbps))
    assert ("software path" in table) == hinted, table
    assert "byte-exact" in table


def test_the_table_shows_the_same_host_path_against_its_targets():
    from kvxferd.rig.bench.gpu import format_table

    figures = _figures(0.4, 1074.0)
    figures["bulk"].update(same_host_gbps=900.0, same_host_ms=0.6, same_host_vs_device_copy=0.69,
                           same_host_byte_exact=False, same_host_wrong_bytes=12, same_host_problems=["rank 0"])
    figures["per_request"].update(same_host={"p50_us": 180.0, "p99_us": 400.0}, device_copy_us=5.0,
                                  same_host_added_p50_us=175.0)
    figures["same_host_copies"] = {"nixl_daemon": 0.0, "same_host_daemon": 210.0}
    table = format_table(figures)
    assert "0.69x the device copy (target >= 0.5)" in table and "added at p50 175 us (target <= 500)" in table
    assert "same-host checked read: WRONG: 12 bytes" in table  # a wrong same-host read is never hidden
    assert "210 by the same-host daemon, 0 by the NIXL one" in table


def test_the_same_host_split_says_where_a_read_went_and_the_table_prints_it():
    from kvxferd.rig.bench.gpu import format_table, same_host_split
    from kvxferd.proto.v1 import kvxfer_pb2 as pb

    reads = [(0.002 + k * 1e-4, pb.Completion(plan_s=1e-4, post_s=3e-4, transfer_s=2e-4 + k * 1e-5, check_s=5e-4,
                                               duration_s=1e-3 + k * 1e-5)) for k in range(3)]
    split = same_host_split(reads)
    assert split == pytest.approx({"plan": 100.0, "post": 300.0, "transfer": 210.0, "check": 500.0,
                                   "outside": 1090.0})
    figures = _figures(0.4, 1074.0)
    figures["per_request"].update(same_host={"p50_us": 2000.0, "p99_us": 2500.0}, device_copy_us=20.0,
                                  same_host_added_p50_us=1980.0, same_host_split_p50_us=split)
    table = format_table(figures)
    assert "post 300 us (plan 100), copies 210, board checks and notices 500, the engine's leg 1090" in table


def test_the_table_says_which_transport_path_the_reads_took():
    from kvxferd.rig.bench.gpu import format_table

    figures = _figures(0.4, 1074.0)
    figures["transport"] = {"read_paths": {"cuda<-cuda: emulated": 1}, "vram_regions": {"legacy_ipc": 2.0}}
    table = format_table(figures)
    assert "READs took cuda<-cuda: emulated (1 endpoint configurations)" in table
    assert "prefill VRAM regions: legacy_ipc 2" in table
    figures["transport"] = {"read_paths": {}, "vram_regions": {}}
    assert "no path UCX reported; prefill VRAM regions: none" in format_table(figures)
