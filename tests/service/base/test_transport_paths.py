"""The transport self-check against real daemons: the path UCX took for a link's READs, in a metric and the log.

On loopback, UCX READs host memory over CMA or shared memory; the negative
control gives the decode daemon UCX's TCP lane alone, where UCX emulates the
READ with messages: the daemon must say so, as a warning. (Across namespace
hosts: tests/rig/verify/hosts/test_fabric.py.)
"""

from __future__ import annotations

import functools
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
