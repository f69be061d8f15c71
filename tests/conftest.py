import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The default run goes over three xdist workers (scripts/test.sh, `--dist loadfile`, with the scheduler
# below). Each test file is one unit of work (module fixtures start daemons and vLLM engines once),
# except the vLLM files, which make two units of about equal length: at most two vLLM files run at
# once. Three side by side put a dozen vLLM processes on the two cores (each worker spins a core for a
# second after every step), and a step could stall for 20-30 s: long enough for an engine's
# registration to lapse (issue #54); one at a time made them the run's longest chain (17 min). Units go
# out in collection order, the longest first, so no worker starts one of them near the end while the
# others sit idle (the rest take under 30 s a file).
VLLM_UNITS = {  # unit -> its files, ~5 min each on 2 cores beside the rest of the suite
    "vllm-a": ("e2e", "tp2_recompute", "swa", "push"),
    "vllm-b": ("serve", "mamba", "prefill_frees", "mla"),
}
VLLM_FILES = {f"tests/integrations/test_vllm_{name}.py": unit for unit, names in VLLM_UNITS.items() for name in names}
LONGEST_FIRST = (
    *VLLM_UNITS,
    "tests/rig/soak/test_soak_run.py",  # ~100 s: the 90 s soak
    "tests/test_cli.py",  # ~60 s: the demo and the benchmarks as subprocesses
    "tests/rig/verify/test_sweep.py",  # ~60 s
    "tests/rig/verify/hosts/test_fabric.py",  # ~50 s: namespace hosts, a demo across two of them
    "tests/rig/verify/hosts/test_late_writes.py",  # ~40 s: two reads cut by a partition
)


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return VLLM_FILES.get(path, path)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but the vLLM files make the units of :data:`VLLM_UNITS` (pytest-xdist's
    ``loadgroup`` marks are not read under pytest 9: xdist 3.8 renames a node through an attribute
    pytest no longer uses)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndVllmUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)
    return FilesAndVllmUnits(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Put :data:`LONGEST_FIRST`'s units first, in that order (a stable sort: units stay whole). A vLLM
    test outside :data:`VLLM_FILES` is a usage error: it would run beside the others."""
    stray = sorted({i.nodeid.split("::", 1)[0] for i in items if i.get_closest_marker("vllm")} - VLLM_FILES.keys())
    if stray:
        raise pytest.UsageError(f"vLLM tests outside tests/conftest.py's VLLM_FILES: {stray}")
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "daemons: starts daemon processes; left out of scripts/test.sh --fast")


@pytest.fixture(autouse=True, scope="session")
def _fast_lane_starts_no_daemon():
    """``scripts/test.sh --fast`` (``KVXFERD_FAST_LANE=1``) promises no daemon process: a test there that
    starts one fails, naming the lane, instead of slowing it down unseen."""
    if os.environ.get("KVXFERD_FAST_LANE") != "1":
        yield
        return
    from kvxferd.client.launch import DaemonProcess

    def refuse(self) -> None:
        raise RuntimeError("scripts/test.sh --fast starts no daemon process: mark this test `daemons` "
                           "(tests/conftest.py) or move it out of the fast lane's folders")
    launch, DaemonProcess._launch = DaemonProcess._launch, refuse
    yield
    DaemonProcess._launch = launch


@pytest.fixture
def arenas():
    """Shared-memory arenas a test makes (``engine_pb(..., arenas)``): closed after it."""
    kept = []
    yield kept
    for arena in kept:
        arena.close()
