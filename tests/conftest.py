import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The default run goes over three xdist workers (scripts/test.sh), one test file per unit of work,
# in collection order. The longest files go first, so no worker starts one of them near the end
# while the others sit idle (seconds on 2 cores; the rest take under 30 s a file).
LONGEST_FIRST = (
    "tests/integrations/test_vllm_e2e.py",  # ~100 s: two vLLM engines
    "tests/integrations/test_vllm_tp2_recompute.py",  # ~100 s: a TP=2 and a TP=1 vLLM engine
    "tests/soak/test_soak_run.py",  # ~100 s: the 90 s soak
    "tests/integrations/test_vllm_serve.py",  # ~60-85 s: two vLLM API servers
    "tests/integrations/test_vllm_mamba.py",  # ~75 s: two Mamba2 vLLM engines
    "tests/integrations/test_vllm_prefill_frees.py",  # ~55 s: two vLLM engines, 1 s CPU windows
    "tests/test_cli.py",  # ~60 s: the demo and the benchmarks as subprocesses
    "tests/verify/test_sweep.py",  # ~60 s
    "tests/verify/hosts/test_fabric.py",  # ~50 s: namespace hosts, a demo across two of them
    "tests/verify/hosts/test_late_writes.py",  # ~40 s: two reads cut by a partition
)


@pytest.fixture
def arenas():
    """Shared-memory arenas a test makes (``engine_pb(..., arenas)``): closed after it."""
    kept = []
    yield kept
    for arena in kept:
        arena.close()


def pytest_collection_modifyitems(config, items) -> None:
    """Put :data:`LONGEST_FIRST`'s files first, in that order (a stable sort: files stay whole)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
