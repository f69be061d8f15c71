"""kvxferd's wheel in a fresh virtual environment without torch (issue #60): the daemon and the demo run.

NIXL's wheels (``nixl-cu12``, ``nixl-cu13`` 1.x) require torch themselves, so the environment gets
kvxferd's own requirements, then one NIXL wheel and the ``nixl`` meta package with ``--no-deps``: as a
torch-free image would. Slow (a venv, pip, the default demo: about two minutes): on request,
``scripts/test.sh -m slow tests/deploy/test_wheel.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(*args, timeout_s: float = 600, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout_s, **kwargs)
    assert run.returncode == 0, f"{args}: {run.stdout[-1500:]} {run.stderr[-3000:]}"
    return run


def test_the_wheel_without_torch_serves_and_runs_the_demo(tmp_path):
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", ROOT)
    (wheel,) = (tmp_path / "dist").glob("kvxferd-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    pip = (venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check")
    _run(*pip, "--no-deps", wheel)
    requirements = [r for r in importlib.metadata.metadata("kvxferd").get_all("Requires-Dist")
                    if "extra ==" not in r and not re.match(r"nixl\b", r)]
    assert not any(r.startswith("torch") for r in requirements)  # the daemon's own: no torch
    _run(*pip, *requirements)
    nixl = importlib.metadata.version("nixl-cu13")
    _run(*pip, "--no-deps", f"nixl-cu13=={nixl}", f"nixl=={importlib.metadata.version('nixl')}")
    probe = subprocess.run([venv / "bin" / "python", "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0  # the negative control: torch is not there
    _run(venv / "bin" / "kvxferd", "serve", "--help", timeout_s=60)
    demo = _run(venv / "bin" / "kvxferd", "demo", "--json", cwd=tmp_path, timeout_s=900)
    summary = json.loads(demo.stdout)
    assert summary["ok"] and summary["mismatched_bytes"] == 0 and summary["requests"] > 0
