import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The default run goes over three xdist workers (scripts/test.sh, `--dist loadgroup`). Each test file
# is one unit of work (module fixtures start daemons and vLLM engines once), except the vLLM files,
# which are one unit together: they run one after another on one worker. Side by side, two or three
# of them put a dozen vLLM processes on the two cores, and a step could stall for 20-30 s: long
# enough for an engine's registration to lapse or an early hold's lease to run out (issue #54).
# Units go out in collection order, the longest first, so no worker starts one of them near the end
# while the others sit idle (the rest take under 30 s a file).
VLLM_GROUP = "vllm"
LONGEST_FIRST = (
    VLLM_GROUP,  # ~7 min: every vLLM file
    "tests/rig/soak/test_soak_run.py",  # ~100 s: the 90 s soak
    "tests/test_cli.py",  # ~60 s: the demo and the benchmarks as subprocesses
    "tests/rig/verify/test_sweep.py",  # ~60 s
    "tests/rig/verify/hosts/test_fabric.py",  # ~50 s: namespace hosts, a demo across two of them
    "tests/rig/verify/hosts/test_late_writes.py",  # ~40 s: two reads cut by a partition
)


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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Group every item (its file, or :data:`VLLM_GROUP`) and put :data:`LONGEST_FIRST` first, in that
    order (a stable sort: groups stay whole)."""
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    units = {}
    for item in items:
        units[item.nodeid] = VLLM_GROUP if item.get_closest_marker("vllm") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(units[item.nodeid]))
    items.sort(key=lambda item: rank.get(units[item.nodeid], len(rank)))
