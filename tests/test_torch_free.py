"""The daemon needs no torch (issue #60): torch is the engine side's (the vLLM connector, the GPU checks),
an extra (``pip install kvxferd[engine]``), never the daemon's dependency.

Here torch cannot be imported at all: a ``sitecustomize`` on PYTHONPATH makes every ``import torch`` fail,
in this test's subprocesses and every process they start (the daemons, the demo's engines). The daemon's
command line and a demo through real daemons and real NIXL still run; the blocker is shown to work first
(the negative control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BLOCKER = '''\
import importlib.abc
import sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name}: torch is blocked here (tests/test_torch_free.py)")
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def _env(tmp_path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def test_the_daemon_and_the_demo_run_where_torch_cannot_be_imported(tmp_path):
    env = _env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr  # the blocker works
    serve = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--help"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert serve.returncode == 0, serve.stderr[-2000:]
    demo = subprocess.run([sys.executable, "-m", "kvxferd", "demo", "--json", "--model", "gqa", "--requests", "2",
                           "--prefill-tp", "2", "--decode-tp", "1", "--num-layers", "1", "--head-size", "64",
                           "--num-tokens", "100"], env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout)
    assert summary["ok"] and summary["mismatched_bytes"] == 0 and summary["digest_checked_bytes"] > 0
