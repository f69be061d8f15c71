"""Grow a process's file-descriptor table once, at start-up, so that it never grows under load.

Linux keeps a process's open files in a table that doubles when a new fd
does not fit (64 -> 128 -> 256 ...) and never shrinks. In a process with
more than one thread, each growth waits for an RCU grace period
(``expand_files`` -> ``synchronize_rcu``), and every other thread that opens
an fd meanwhile waits with it. A daemon opens fds in bursts exactly when it
must be quick: UCX accepts and opens sockets while peers handshake.

Found by the test suite on a loaded 2-core VM: a prefill daemon's NIXL
progress and its reader's ``add_remote_agent`` sat 1.5-25 s in the kernel
(threads in state D, ``wchan`` ``expand_files`` / ``synchronize_rcu_normal``,
in ``accept`` and ``openat``); handshakes outlived reads' deadlines and holds
ended late. Measured alone on that machine, each growth of a two-thread
process's table took 6-20 ms.

Reserving the table up front costs ``RESERVED_FDS`` x 8 bytes (128 KiB).
``kvxferd serve`` does it before any import starts a thread (``cli.py``), and
so do the engine processes of the demo, the soak and the benchmarks
(``verify/process.py``): a process with one thread grows its table without
waiting for RCU at all. Beside ``osthreads.py``: both shape the OS process
that runs NIXL agents.
"""

from __future__ import annotations

import fcntl
import os
import resource

RESERVED_FDS = 16384  # a daemon's UCX endpoints, sockets and engine arenas fit well within this


def fd_table_size() -> int:
    """How many fds this process's table holds now (``FDSize`` of /proc/self/status; 0 if unknown)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def reserve_fd_table(num_fds: int = RESERVED_FDS) -> int:
    """Grow this process's fd table to hold ``num_fds`` fds (at most the soft ``RLIMIT_NOFILE``) now.

    Returns the table size afterwards. Never closes or moves an open fd:
    it duplicates one onto the lowest free number at or above the top
    (``F_DUPFD``), which makes the kernel grow the table, then closes it.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(num_fds, soft if soft != resource.RLIM_INFINITY else num_fds) - 1
    size = fd_table_size()
    if top <= size:
        return size
    probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        high = fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, top)
        os.close(high)
    except OSError:  # a limit lower than we read, or fds up there all taken: grow as needed later
        pass
    finally:
        os.close(probe)
    return fd_table_size()
