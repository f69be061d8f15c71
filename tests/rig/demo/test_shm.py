"""The demo checks /dev/shm before it starts anything (a container's default 64 MB made it die as
"prefill engine did not start ... Socket closed")."""

import os

import numpy as np
import pytest

from kvxferd import cli
from kvxferd.client import DaemonProcess
from kvxferd.rig.demo import shm
from kvxferd.rig.verify.buffers import allocate_engine
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups

MIB = 1 << 20


def _statvfs(free_bytes: int):
    """A tmpfs of 4 KiB blocks with ``free_bytes`` free, as os.statvfs reports it."""
    blocks = free_bytes // 4096
    return lambda path: os.statvfs_result((4096, 4096, 1 << 20, blocks, blocks, 0, 0, 0, 0, 255))


@pytest.mark.parametrize("model", MODELS)
def test_engine_bytes_are_what_the_engines_allocate(model):
    shape = ModelShape(num_layers=2, num_kv_heads=4, head_size=32, block_size=16, num_blocks=8)
    for groups, tp_size in zip(model_groups(model, shape), (4, 2)):
        asked = []
        for rank in range(tp_size):
            allocate_engine("e", groups, tp_size, rank, tagged=False,
                            allocate=lambda n: (asked.append(n), np.empty(n, np.uint8))[1])
        assert shm.engine_bytes(groups, tp_size) == sum(asked)


def test_a_small_dev_shm_is_named_with_free_needed_and_the_fix():
    message = shm.shortfall(166 * MIB, 64 * MIB, statvfs=_statvfs(64 * MIB))
    assert message is not None and "\n" not in message
    assert "/dev/shm has 64 MiB free" in message and "needs about 230 MiB" in message
    assert "--shm-size=1g" in message


def test_enough_room_is_no_complaint():
    assert shm.shortfall(166 * MIB, 64 * MIB, statvfs=_statvfs(1 << 30)) is None
    assert shm.shortfall(166 * MIB, 64 * MIB, statvfs=_statvfs(230 * MIB)) is None


def test_no_dev_shm_to_measure_is_no_complaint():
    def missing(path):
        raise FileNotFoundError(path)
    assert shm.shortfall(1, 1, statvfs=missing) is None


def test_the_demo_refuses_before_starting_a_daemon(monkeypatch, capsys):
    monkeypatch.setattr(os, "statvfs", _statvfs(64 * MIB))

    def no_daemons(*args, **kwargs):
        raise AssertionError("a daemon started although /dev/shm is too small")
    monkeypatch.setattr(DaemonProcess, "start_many", no_daemons)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvxferd demo: /dev/shm has 64 MiB free, the demo needs about ") and "\n" not in err
    assert "--shm-size=1g" in err
    # the default demo's peak: the hybrid preset's caches (166 MiB) and 8 NIXL agents
    caches, ucx = shm.needed_bytes(MODELS, ModelShape(num_layers=4, num_kv_heads=8, head_size=128, block_size=16,
                                                      num_blocks=64, layout="packed"), 4, 2, 6)
    assert round(caches / MIB) == 166 and ucx == 8 * shm.UCX_BYTES_PER_AGENT
