"""docs/vllm.md's path over HTTP: two vLLM API servers with the connector, their daemons, and the proxy.

Runs ``kvxferd/rig/vllm/bench.py`` small: the same prompts straight to one
instance and through the proxy must give the same tokens, and the decode
daemon must read exactly the prompt's blocks.
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def free_base_port() -> int:
    """A base port whose proxy (-100), prefill (+0), decode (+100) and daemon (+600..+612) ports are all free."""
    for _ in range(50):
        base = random.randrange(20_000, 30_000)
        try:
            for port in (base - 100, base, base + 100, *range(base + 600, base + 613)):  # proxy, servers, daemons
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def test_the_proxy_returns_the_single_instance_tokens():
    pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (scripts/bootstrap.sh --vllm)")
    run = subprocess.run([sys.executable, "-m", "kvxferd.rig.vllm.bench", "--requests", "1", "--lengths", "40", "100",
                          "--base-port", str(free_base_port()), "--disconnect-check", "--trace"], capture_output=True, text=True, timeout=600)
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert run.returncode == 0 and len(rows) == 2, run.stdout + run.stderr[-3000:]
    # A client that left mid-stream through the proxy pinned no prefill hold, and P/D served on.
    assert "disconnect check: ok" in run.stdout, run.stdout
    # --trace: each P/D request's stamps from the client, proxy, both engines and the decode daemon joined
    # into segments that add up to its TTFT (kvxferd/rig/vllm/tracejoin.py)
    trace = {line.split("|")[1].strip(): line.split("|")[3:-1] for line in run.stdout.splitlines()
             if line.startswith("| ")}
    assert [cell.strip() for cell in trace["requests"]] == ["1", "1"], run.stdout
    # each prefill's hold went out with the step that computed its prompt (scheduler.py, early holds)
    assert [cell.strip() for cell in trace["of which held with the prompt's step"]] == ["1", "1"], run.stdout
    for total, ttft in zip(trace["sum of the medians"], trace["median TTFT (P/D)"]):
        assert abs(float(total) - float(ttft)) < 0.2, (total, ttft)
    for tokens, _requests, _single, _pd, _ratio, kib, equal in rows:
        assert equal.strip() == "True", rows
        assert int(kib) == -(-int(tokens) // 32) * 64, rows  # 64 KiB per block of 32 tokens, read once
