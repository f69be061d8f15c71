"""Reading UCX's protocol-selection report: tables parsed, paths named, files read whole lines at a time.

The texts are UCX's own format (as nixl 1.5.1's UCX writes it here); the
last tests make real NIXL agents write them and read the file they wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvxferd.xfer.nixl.ucxpaths import FAST_PATHS, PATHS, UcxLog, classify, log_environment, parse

PREFIX = "[1796021751.874573] [vm:9155 :0]   "


def table(worker: str, locality: str, operation: str, rows: list[tuple[str, str, str]]) -> str:
    rule = "+--------+-------------+-------------------------------------------+"
    lines = [rule, f"| {worker} {locality} cfg#1 |", f"| {operation} |", rule,
             "| Range  | Description |                  Config                   |", rule]
    lines += [f"| {size} | {how} | {lanes} |" for size, how, lanes in rows] + [rule]
    return "".join(PREFIX + line + "\n" for line in lines)


READ_HOST = "remote memory read by ucp_get*(multi) into host memory from host"
# A device's memory is named with its device (UCX's ucp_proto_select_param_str), not as "<type> memory".
READ_CUDA = "remote memory read by ucp_get* into cuda/GPU0 from cuda/GPU1"
CAPTURED = os.path.join(os.path.dirname(__file__), "ucx_proto_info.log")  # written by nixl 1.5.1's UCX here


@pytest.mark.parametrize("how, lanes, path", [
    ("zero-copy", "cma/memory", "cma"),
    ("zero-copy", "sysv/memory", "shared_memory"),
    ("zero-copy", "cuda_ipc/cuda", "cuda_ipc"),
    ("zero-copy", "rc_mlx5/mlx5_0:1", "rdma"),
    ("zero-copy", "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1", "rdma"),
    ("software emulation", "tcp/lo", "emulated"),
    ("software emulation", "rc_mlx5/mlx5_0:1", "emulated"),
    ("zero-copy", "tcp/eth0", "tcp"),
    ("zero-copy", "cma/memory and tcp/lo", "other"),
    ("zero-copy", "nothing-like-a-lane", "other"),
])
def test_transport_path_classified(how, lanes, path):
    assert classify(how, lanes) == path
    assert path in PATHS


def test_transport_path_parsed_from_read_tables_only():
    text = (table("A", "self", "remote memory write by ucp_put* from host memory to host", [("0..inf", "zero-copy", "cma/memory")])
            + table("dec.0", "intra-node", READ_HOST, [("0..inf", "software emulation", "tcp/lo")])
            + table("dec.0", "inter-node", READ_CUDA, [("0..8192", "zero-copy", "cuda_copy/cuda"),
                                                        ("8193..inf", "zero-copy", "rc_mlx5/mlx5_0:1")])
            + PREFIX.rstrip() + " ucp_worker.c:1234 UCX  WARN  a warning UCX gave\n"
            + PREFIX.rstrip() + " ucp_worker.c:99 UCX  DIAG  a diagnostic\n")
    found, messages = parse(text)
    assert [(f.worker, f.locality, f.memory, f.path) for f in found] == [
        ("dec.0", "intra-node", "host<-host", "emulated"), ("dec.0", "inter-node", "cuda<-cuda", "rdma")]
    assert found[0].emulated and not found[1].emulated
    assert "8193..inf zero-copy over rc_mlx5/mlx5_0:1" in found[1].describe()
    assert [level for level, _ in messages] == ["WARN"] and "a warning UCX gave" in messages[0][1]


def test_transport_path_parsed_from_captured_ucx_output():
    """UCX's own lines (UCX_TLS=tcp): the active-message table before it is not a READ."""
    found, messages = parse(open(CAPTURED).read())
    assert [(f.worker, f.locality, f.memory, f.path, f.rows) for f in found] == [
        ("B", "intra-node", "host<-host", "emulated", (("0..inf", "software emulation", "tcp/lo"),))]
    assert messages == []


@pytest.mark.parametrize("operation, memory", [
    ("remote memory read by ucp_get* into cuda/GPU0 from cuda/GPU1", "cuda<-cuda"),
    ("remote memory read by ucp_get*(multi) into iov[3] cuda/GPU0 from host", "cuda<-host"),
    ("remote memory read by ucp_get* into host memory from cuda", "host<-cuda"),
])
def test_transport_path_memory_named_either_way(operation, memory):
    found, _ = parse(table("w", "inter-node", operation, [("0..16K", "zero-copy", "cuda_copy/cuda"),
                                                           ("16K..inf", "zero-copy", "rc_mlx5/mlx5_0:1")]))
    assert [(f.memory, f.path) for f in found] == [(memory, "rdma")]  # the K-suffixed last row decides


def test_transport_path_title_that_does_not_parse_lends_nothing():
    text = (table("A", "self", READ_HOST, [("0..inf", "zero-copy", "self/memory")])
            + table("has spaces", "intra-node", READ_HOST, [("0..inf", "zero-copy", "cma/memory")])
            + table("odd", "somewhere", READ_HOST, [("0..inf", "software emulation", "tcp/lo")]))
    found, _ = parse(text)
    assert [(f.worker, f.locality, f.path) for f in found] == [("A", "self", "other"), ("has spaces", "intra-node", "cma")]


def test_transport_path_offsets_count_bytes_whatever_they_are(tmp_path):
    """A name with bytes that are not UTF-8 (UCX cuts worker names at 31 bytes, inside a character): read
    once, never again."""
    path = tmp_path / "ucx.7.log"
    ucx = UcxLog(str(tmp_path / "ucx.%p.log"))
    body = table("\u00e9" * 15, "intra-node", READ_HOST, [("0..inf", "zero-copy", "cma/memory")]).encode()
    path.write_bytes(body.replace("\u00e9".encode(), b"\xc3", 1) + b"[1] [h:7:0] x.c:1 UCX  WARN  once\n")
    new, messages = ucx.read()
    assert [s.path for _, s in new] == ["cma"] and len(messages) == 1
    assert ucx.read() == ([], [])  # the offset is the file's size: nothing is read or said twice


def test_transport_path_read_whole_tables_as_they_are_written(tmp_path):
    path = tmp_path / "ucx.4242.log"
    ucx = UcxLog(str(tmp_path / "ucx.%p.log"))
    whole = table("dec.0", "intra-node", READ_HOST, [("0..inf", "zero-copy", "cma/memory")])
    cut = len(whole) - 30  # inside the table's last rule: the table is not complete yet
    path.write_text(whole[:cut])
    assert ucx.read() == ([], [])
    with open(path, "a") as file:
        file.write(whole[cut:])
    new, _ = ucx.read()
    assert [(pid, s.path) for pid, s in new] == [(4242, "cma")]
    assert ucx.read() == ([], [])  # nothing new: nothing said twice
    # UCX rotated the file (a new one in its place): read from its start; the same selection is not new.
    os.rename(path, f"{path}.1")
    path.write_text(whole)
    assert ucx.read() == ([], [])
    path.with_suffix(".new").write_text(table("dec.0", "intra-node", READ_HOST, [("0..inf", "software emulation", "tcp/lo")]) * 2)
    os.replace(path.with_suffix(".new"), path)  # longer than what was read of the old one
    assert [s.path for _, s in ucx.read()[0]] == ["emulated"]  # the same endpoint, a new choice: said


def test_transport_path_environment_leaves_an_operators_own_settings():
    assert log_environment("/d", {})["UCX_LOG_FILE"] == "/d/ucx.%p.log"
    assert "UCX_LOG_FILE" not in log_environment("/d", {"UCX_LOG_FILE": "/mine.log"})
    assert log_environment("/d", {})["UCX_PROTO_INFO"] == "y"


PROBE = textwrap.dedent("""
    import numpy as np, time
    from kvxferd.xfer.nixl.nixl_module import nixl_api
    from kvxferd.xfer.nixl.ucxpaths import flush_c_streams
    api = nixl_api()[0]
    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    holder, reader = api.nixl_agent("holder", config), api.nixl_agent("reader", config)
    src, dst = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
    holder.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    reader.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    reader.add_remote_agent(holder.get_agent_metadata())
    handle = reader.initialize_xfer("READ", reader.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
                                    holder.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"), "holder")
    reader.transfer(handle)
    deadline = time.monotonic() + 20
    while reader.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
        holder.get_new_notifs()
    assert reader.check_xfer_state(handle) == "DONE" and (dst == src).all()
    flush_c_streams()
""")


@pytest.mark.parametrize("transports, expected", [(None, FAST_PATHS), ("tcp", {"emulated"})])
def test_transport_path_of_a_real_nixl_read(tmp_path, transports, expected):
    """Two real agents READ host memory; the path UCX reports is read back from its file. The control:
    with UCX's TCP lane alone, the same READ is emulated, and the report says so."""
    env = {**os.environ, **log_environment(str(tmp_path), {})}
    env.pop("UCX_TLS", None)
    if transports:
        env["UCX_TLS"] = transports
    subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, timeout=120, capture_output=True)
    new, _ = UcxLog(str(tmp_path / "ucx.%p.log")).read()
    reads = {s.path for _, s in new if s.worker == "reader" and s.memory == "host<-host" and s.locality != "self"}
    assert reads and reads <= set(expected), reads
