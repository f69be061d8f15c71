"""The daemon's fd table is grown once at start-up (``xfer/osutil/fdtable.py``): in a fresh process, growing it
moves or closes no open fd and leaves none behind; a low RLIMIT_NOFILE caps it without an error."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, resource, sys
from kvxferd.xfer.osutil.fdtable import fd_table_size, reserve_fd_table
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
os.dup2(mine[0], 40)  # an fd up high, below the top: must stay as it is
def fds():
    return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in map(int, os.listdir("/proc/self/fd"))
            if os.path.exists(f"/proc/self/fd/{fd}")}
before, size_before = fds(), fd_table_size()
size = reserve_fd_table(4096)
print(json.dumps({"before": size_before, "after": size, "again": reserve_fd_table(4096),
                  "same_fds": fds() == before}))
"""


def _run(limit: int) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(limit)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_the_table_grows_to_the_reserve_and_no_fd_moves():
    result = _run(0)
    assert result["before"] < 4096 <= result["after"] == result["again"]
    assert result["same_fds"]


def test_a_low_open_files_limit_caps_the_reserve():
    result = _run(200)
    assert 200 <= result["after"] < 4096 and result["same_fds"]
