"""Starting a worker so that nothing of the control plane's comes with it (docs/dataplane.md).

A fork would copy the control plane's heap, and with it the TLS keys, the
host secret and every session it holds. A worker is a fresh interpreter
(``exec``) that inherits one descriptor, its channel, and only the
environment UCX, NIXL, CUDA and Python need: a variable of the daemon's own
(``KVXFERD_*``: its configuration) or of anything else stays behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

# Variables a worker keeps: by prefix, and by exact name.
KEPT_PREFIXES = ("UCX_", "NIXL_", "CUDA_", "NVIDIA_", "LC_")
KEPT_NAMES = frozenset({"PATH", "LD_LIBRARY_PATH", "LANG", "TZ", "TMPDIR", "HOME", "PYTHONPATH", "PYTHONHOME",
                        "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE"})


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What of ``environ`` a worker gets."""
    return {name: value for name, value in environ.items()
            if name in KEPT_NAMES or name.startswith(KEPT_PREFIXES)}


def spawn_worker(channel_fd: int, *, role: str = "holder",
                 environ: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``python -m kvxferd.worker`` with ``channel_fd`` as its one inherited descriptor (besides stdio: stdin
    and stdout /dev/null, so it cannot write the daemon's ready line; stderr a pipe, for NIXL's and its own
    log lines, which the supervisor relays as data: :mod:`kvxferd.service.workers.output`). ``role`` (holder or
    reader) shows in its command line, and it maps nothing of the other role."""
    environment = worker_environment(os.environ if environ is None else environ)
    log_directory = os.path.dirname(environment.get("UCX_LOG_FILE", ""))
    if log_directory:  # UCX aborts a process whose log file cannot be opened: never for a directory gone
        os.makedirs(log_directory, mode=0o700, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "kvxferd.worker", "--channel-fd", str(channel_fd),
                             "--parent-pid", str(os.getpid()), "--role", role],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            pass_fds=(channel_fd,), close_fds=True,
                            env=environment)
