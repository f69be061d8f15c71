"""The transport self-check against real daemons: the path UCX took for a link's READs, in a metric and the log.

On loopback, UCX READs host memory over CMA or shared memory; the negative
control gives the decode daemon UCX's TCP lane alone, where UCX emulates the
READ with messages: the daemon must say so, as a warning. (Across namespace
hosts: tests/rig/verify/hosts/test_fabric.py.)
"""

from __future__ import annotations

import functools
import os
import glob
import json

import pytest

from kvxferd.client.launch import DaemonProcess
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.xfer.nixl.ucxpaths import FAST_PATHS
from tests.service.helpers import GQA_GROUPS



def cluster(workdir, name, *args, env=None):
    return DaemonCluster(*GQA_GROUPS, 1, 1, workdir=str(workdir), name=name, daemon_args=args,
                         start_many=functools.partial(DaemonProcess.start_many, env=env or {}))


def lines(daemon: DaemonProcess, message: str) -> list[dict]:
    return [json.loads(line) for line in daemon.tail().splitlines() if message in line]


@pytest.mark.parametrize("env, fast", [({}, True), ({"UCX_TLS": "tcp"}, False)], ids=["loopback", "tcp_only"])
def test_transport_path_of_a_link_is_named(workdir, env, fast):
    c = cluster(workdir, f"tp{len(env)}", "--no-same-host-reads", env=env)
    try:
        decode = c.decode_daemons[0]
        paths = decode.transport_paths()
        host_paths = {key.split(": ")[1] for key in paths if key.startswith("host<-host: ")}
        said = lines(decode, "transport path: READ host<-host takes")
        handshake = lines(decode, "handshake done")[-1]
        if fast:
            assert host_paths and host_paths <= FAST_PATHS, paths
            assert said and all(line["level"] == "INFO" for line in said)
        else:  # the control: UCX has no lane that READs host memory directly
            assert host_paths == {"emulated"}, paths
            assert said and all(line["level"] == "WARNING" and "software emulation over tcp" in line["ucx"]
                                for line in said)
        assert handshake["read_paths"] == ", ".join(f"host<-host intra-node: {p}" for p in sorted(host_paths))
        assert said[0]["after"] == f"handshake of tp{len(env)}-decode with tp{len(env)}-prefill"
    finally:
        c.close()
    assert not glob.glob(f"/tmp/kvxferd-ucx-*/ucx.{decode.process.pid}.log")  # removed with the daemon


def test_transport_path_same_host_and_check_off(workdir):
    """A same-host link's data is copied, not READ over NIXL, and the handshake says so (its probe still
    READs the holder's board over NIXL); without the check nothing is known."""
    c = cluster(workdir, "tps", env={})
    try:
        assert lines(c.decode_daemons[0], "handshake done")[-1]["read_paths"] == "same-host copy"
    finally:
        c.close()
    c = cluster(workdir, "tpoff", "--no-same-host-reads", "--no-transport-check", env={})
    try:
        decode = c.decode_daemons[0]
        assert lines(decode, "handshake done")[-1]["read_paths"] == "unknown (transport self-check off)"
        assert decode.transport_paths() == {} and not lines(decode, "transport path:")
    finally:
        c.close()


def test_transport_path_rdma_devices_decide_the_start_with_require_rdma(tmp_path, workdir):
    from kvxferd.service.base.transports import host_rdma, rdma_refusal

    assert host_rdma(str(tmp_path)) == ([], False) and rdma_refusal(False, str(tmp_path)) is None
    assert "no RDMA device" in rdma_refusal(True, str(tmp_path))
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    assert host_rdma(str(tmp_path)) == (["mlx5_0"], True) and rdma_refusal(True, str(tmp_path)) is None
    if host_rdma()[0]:
        return  # this machine has an RDMA device: the daemon would start
    daemon = DaemonProcess("norm", socket_dir=str(workdir), extra_args=("--require-rdma-capable-vram",), wait=False)
    assert daemon.process.wait(60) != 0
    assert "require_rdma_capable_vram is set but this host has no RDMA device" in daemon.process.stdout.read()


def test_transport_path_gauge_follows_what_ucx_says_now(tmp_path, caplog):
    """The gauge is set anew each time: a changed path leaves no old series, a process that exited takes its
    paths with it; a flood of UCX warnings is counted, not copied; a dead daemon's directory is removed."""
    import logging
    import os

    from kvxferd.service.base.metrics import Metrics
    from kvxferd.service.base.transports import MAX_RELAYED_LINES, TransportPaths, remove_stale_directories
    from tests.xfer.nixl.test_ucxpaths import PREFIX, READ_HOST, table

    metrics = Metrics()
    paths = TransportPaths(metrics.transport_paths)
    env = paths.environment({})
    try:
        def value(path):
            return metrics.transport_paths.labels("host<-host", path)._value.get()

        own = os.path.join(paths.directory, f"ucx.{os.getpid()}.log")
        with open(own, "w") as file:
            file.write(table("me", "intra-node", READ_HOST, [("0..inf", "zero-copy", "cma/memory")]))
        with open(os.path.join(paths.directory, "ucx.999999999.log"), "w") as file:  # a process that exited
            file.write(table("gone", "intra-node", READ_HOST, [("0..inf", "software emulation", "tcp/lo")]))
        paths.refresh()
        assert (value("cma"), value("emulated")) == (1, 0)  # the exited one's was read, then forgotten
        os.rename(own, own + ".1")
        with open(own, "w") as file:  # UCX rotated its file; the same endpoint chose again
            file.write(table("me", "intra-node", READ_HOST, [("0..inf", "software emulation", "tcp/lo")]))
            file.write("".join(f"{PREFIX.rstrip()} x.c:1 UCX  WARN  flood {n}\n" for n in range(30)))
        with caplog.at_level(logging.INFO):
            paths.refresh()
        assert (value("cma"), value("emulated")) == (0, 1)
        relayed = [r for r in caplog.records if r.getMessage().startswith("UCX: flood")]
        assert len(relayed) == MAX_RELAYED_LINES and "10 more warnings and errors not relayed" in caplog.text
        assert env["UCX_LOG_FILE"] == os.path.join(paths.directory, "ucx.%p.log")
    finally:
        paths.close()
    import fcntl
    stale = tmp_path / "kvxferd-ucx-999999999-abc"
    stale.mkdir()
    (stale / "daemon.lock").touch()
    (stale / "ucx.999999999.log").write_text(f"{PREFIX.rstrip()} x.c:1 UCX  ERROR Caught signal 11\n")
    live = tmp_path / "kvxferd-ucx-999999998-abc"  # a pid this namespace cannot see, its lock held: alive
    live.mkdir()
    held = os.open(live / "daemon.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    with caplog.at_level(logging.WARNING):
        remove_stale_directories(str(tmp_path))
    os.close(held)
    assert not stale.exists() and live.exists() and "Caught signal 11" in caplog.text


def test_transport_path_directories_of_daemons_starting_together_survive():
    """Daemons that start at once each clean up dead daemons' directories: none removes a live one (the
    soak across hosts, seed 66: a directory removed between its making and its lock; its workers' UCX
    then aborted opening their log files)."""
    import os
    import threading

    from kvxferd.service.base.transports import TransportPaths

    for _ in range(5):
        paths = [TransportPaths() for _ in range(8)]
        start = threading.Barrier(len(paths))

        def begin(p):
            start.wait()
            p.environment({})

        threads = [threading.Thread(target=begin, args=(p,)) for p in paths]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        try:
            assert all(os.path.isdir(p.directory) for p in paths)
        finally:
            for p in paths:
                p.close()


def test_transport_path_check_off_where_no_directory_can_be_made(tmp_path, monkeypatch, caplog):
    """A read-only temporary directory turns the check off with a warning; the daemon is not stopped."""
    import logging
    import tempfile

    from kvxferd.service.base.transports import TransportPaths

    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    monkeypatch.setattr(tempfile, "tempdir", str(readonly))
    paths = TransportPaths()
    with caplog.at_level(logging.WARNING):
        if os.geteuid() == 0:  # root writes anyway: make the directory call fail as a read-only mount would
            monkeypatch.setattr(tempfile, "mkdtemp", lambda **kwargs: (_ for _ in ()).throw(OSError(30, "Read-only")))
        assert paths.environment({}) == {}
    assert not paths.enabled and paths.describe() == "unknown (transport self-check off)"
    assert "transport self-check off: cannot make its directory" in caplog.text
