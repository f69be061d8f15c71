"""``kvxferd bench gpu`` where there is no GPU: one clear line and exit 2 (tests/gpu runs it on a GPU)."""

import subprocess
import sys

import pytest

from kvxferd.verify.gpu import cuda_missing

pytestmark = pytest.mark.skipif(not cuda_missing(), reason="this machine has a GPU: tests/gpu runs the benchmark")


def test_bench_gpu_without_a_gpu_says_why_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "gpu", "--quick"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.startswith("kvxferd bench gpu: needs a CUDA GPU: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr

