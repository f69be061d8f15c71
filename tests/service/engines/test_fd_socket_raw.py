"""Issue 40: the fd socket as docs/protocol.md documents it, spoken by a client that imports no kvxferd code.

``fd_client_raw.py`` (its own process, ``python -I``) passes a memfd over raw
``sendmsg``/``SCM_RIGHTS`` and registers and holds through stubs protoc
generates here from ``protos/``. This test then reads that engine's blocks
from a decode engine of its own and checks them byte for byte; the control
overwrites the memfd and sees the next read change, so the daemon read the
very memory the raw client passed.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.messages import engine_to_pb

ROOT = pathlib.Path(__file__).resolve().parents[3]
CLIENT = pathlib.Path(__file__).with_name("fd_client_raw.py")
GROUPS = model_groups("gqa", ModelShape())
ENGINE_ID = "raw-prefill"


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="fdr") as c:
        yield c


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> str:
    """Python modules generated from the .proto files, as an outside client would make them."""
    out = tmp_path_factory.mktemp("gen")
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={out}",
                    f"--grpc_python_out={out}", *protos], cwd=ROOT, check=True)
    for folder in ("kvxferd", "kvxferd/proto", "kvxferd/proto/v1"):  # regular packages: found before ours
        (out / folder / "__init__.py").touch()
    return str(out)


class MemfdEngine:
    """A tagged prefill engine rank whose cache lies in a memfd (what the raw client passes)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvx-raw", 0)
        self.maps: list[mmap.mmap] = []

        def allocate(num_bytes):
            os.ftruncate(self.fd, num_bytes)
            self.maps.append(mmap.mmap(self.fd, num_bytes))
            return np.frombuffer(self.maps[-1], dtype=np.uint8)

        self.engine = allocate_engine(ENGINE_ID, GROUPS[0], 1, 0, tagged=True, allocate=allocate)
        self.message = engine_to_pb(self.engine.cache, with_addresses=False)
        base = self.engine.arena.ctypes.data
        for group_pb, memory in zip(self.message.groups, self.engine.cache.memory):
            for region_pb, region in zip(group_pb.regions, memory):
                region_pb.handle.shm_fd_index = 0  # fd 0 of the delivery
                region_pb.handle.offset = region.address - base

    def close(self) -> None:
        del self.engine
        os.close(self.fd)


def test_an_engine_written_from_the_docs_passes_its_memory_over_the_fd_socket(cluster, generated, tmp_path):
    memfd = MemfdEngine()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": memfd.message.SerializeToString().hex(), "fd": memfd.fd,
                                "token": "raw-token-1"}))
    client = subprocess.Popen([sys.executable, "-I", str(CLIENT), generated, cluster.prefill_daemons[0].socket,
                               str(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              pass_fds=(memfd.fd,))
    try:
        line = client.stdout.readline()
        assert line, f"the raw client ended: {client.wait(10)}"
        report = json.loads(line)
        assert report["kvxferd_modules"] == [] and report["generated_from"].startswith(generated), report
        assert report["malformed"].startswith("refused: "), report
        assert report["first"] == "ok", report
        assert report["again"].startswith("refused: max_fd_tokens"), report
        assert report["unknown_token"].startswith("INVALID_ARGUMENT fd_token"), report
        assert report["registered"], report
        assert report["token_taken"].startswith("INVALID_ARGUMENT fd_token"), report  # one Register took it

        decode = cluster.decode_clients[0]
        decode.handshake(ENGINE_ID, [cluster.prefill_daemons[0].peer_address])

        def read(name: str, seed: int) -> tuple[list[str], int]:
            request = random_request(name, *GROUPS, 48, np.random.default_rng(seed))
            block_ids = [[int(b) for b in ids] for ids in request.remote_block_ids]
            client.stdin.write(f"hold {request.remote_request_id} {json.dumps(block_ids)}\n")
            client.stdin.flush()
            verb, capability = client.stdout.readline().split()
            assert verb == "capability"
            cluster.reset_decode()
            decode.submit_read(request.request_id, ENGINE_ID, request.remote_request_id, request.local_block_ids,
                               request.remote_block_ids, remote_capabilities=[bytes.fromhex(capability)])
            completion = decode.reads.wait_completion(request.request_id, 30)
            assert completion.ok, completion.error
            return cluster.verify(request)

        assert read("raw-1", 1) == ([], 0)
        memfd.engine.arena[:] = 0  # control: the daemon reads this very memory
        problems, wrong = read("raw-2", 2)
        assert wrong > 0 and problems, "a read of zeroed memory still matched the oracle"
        client.stdin.write("stop\n")
        client.stdin.flush()
        assert client.wait(20) == 0
    finally:
        if client.poll() is None:
            client.kill()
        memfd.close()
