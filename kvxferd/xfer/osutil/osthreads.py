"""Give the daemon's own threads their names in the OS, so ``top -H``, ``ps -L`` and ``/proc`` show them.

Python names a thread only for Python: every thread of a daemon shows as
``python`` to the kernel. Finding which thread of a stalled daemon was stuck
in the kernel (docs/reliability.md, the fd-table stall) needed these names.
"""

from __future__ import annotations

import ctypes
import sys
import threading

PR_SET_NAME = 15  # prctl(2)
MAX_NAME_BYTES = 15  # the kernel keeps 16 bytes with the terminating NUL

# The C library the process already has (no ldconfig run at import, as find_library would).
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def os_thread_name(name: str) -> bytes:
    """``name`` as the kernel will keep it: ``kvxferd-`` shortened to ``kvx-``, then at most 15 bytes."""
    short = name.replace("kvxferd-", "kvx-", 1) if name.startswith("kvxferd-") else name
    return short.encode("ascii", "replace")[:MAX_NAME_BYTES]


def name_this_thread(name: str | None = None) -> None:
    """Give the calling thread ``name`` (default: its Python name) in the OS (Linux; elsewhere nothing
    happens). Call it first in a thread's target."""
    if _libc is not None:
        name = threading.current_thread().name if name is None else name
        _libc.prctl(PR_SET_NAME, ctypes.c_char_p(os_thread_name(name)), 0, 0, 0)
