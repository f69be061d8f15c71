"""The GPU check of a lent machine where there is none: the probe and the script say why and exit 2; the
probe's verdict lines (the probe itself runs on a GPU: scripts/gpu-check.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvxferd.rig.verify.gpu import cuda_missing
from kvxferd.rig.verify.memmodel import CANDIDATES, verdict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_memory_model_verdicts_name_what_works():
    good = {"candidate": "vmm_fd", "read": "byte-exact", "gbps": 41.5, "ucx_path": ["rdma"], "export_again": "ok",
            "dma_buf": "ok"}
    assert verdict(good) == ("vmm_fd: read byte-exact at 41.5 GB/s over rdma; exportable again; "
                             "a NIC can register it by DMA-BUF")
    legacy = {**good, "candidate": "legacy_ipc", "ucx_path": ["emulated"], "export_again": "InvalidArgumentError: x",
              "dma_buf": "InvalidArgumentError: y"}
    assert verdict(legacy).endswith("over emulated; not exportable again; no DMA-BUF export")
    assert verdict({"candidate": "daemon_owned", "error": "the holder exited (1)"}) == \
        "daemon_owned: FAILED: the holder exited (1)"
    assert CANDIDATES == ("legacy_ipc", "vmm_fd", "daemon_owned")


@pytest.mark.skipif(not cuda_missing(), reason="this machine has a GPU: run scripts/gpu-check.sh")
@pytest.mark.parametrize("command", [[sys.executable, "-m", "kvxferd.rig.verify.memmodel"],
                                     ["bash", "scripts/gpu-check.sh", sys.executable]], ids=["probe", "script"])
def test_gpu_check_without_a_gpu_says_why_and_exits_2(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, done
    assert subprocess.run(["bash", "-n", "scripts/gpu-check.sh"], cwd=REPO).returncode == 0
