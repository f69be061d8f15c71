"""NIXL loads without importing torch on a CPU-only set-up, and picks the backend the meta package would."""

import subprocess
import sys

from kvxferd.xfer.nixl.nixl_module import torch_cuda_on_disk


def test_a_cpu_build_of_torch_names_no_cuda_version():
    assert torch_cuda_on_disk() == ""  # these machines carry torch's CPU build


def test_an_agent_starts_without_importing_torch():
    code = ("import sys\nfrom kvxferd.xfer.nixl.agent import NixlAgent\nagent = NixlAgent('no-torch')\n"
            "print('torch' in sys.modules, type(agent.raw).__module__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "nixl_cu13._api"]


def test_with_torch_loaded_the_meta_package_decides():
    code = ("import torch, sys\nfrom kvxferd.xfer.nixl.agent import NixlAgent\nagent = NixlAgent('with-torch')\n"
            "print('nixl' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"]
