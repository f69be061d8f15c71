"""The worker's operating-system boundary: Landlock, once its agents exist (docs/dataplane.md).

A worker runs as the daemon's user, so code running in it (a peer that owns
it through its NIXL metadata over UCX's TCP lane) could otherwise open what
that user can: the daemon's TLS key and host secret files, and through
``/proc/<daemon pid>`` its environment, memory and descriptors (the kept
copies of other engines' shared memory). Once its agents are made and its
memory mapped, the worker restricts itself, for good:

* files: read (and run) only beneath the interpreter's prefixes, the library
  directories, ``/sys`` and its own ``/proc/<pid>``; ``/dev/shm`` (UCX's shared-memory
  segments) read-write; nothing else, ``/etc`` included;
* ``ptrace``-class access to processes outside its Landlock domain is refused
  by the kernel: no ``/proc/<daemon>/mem``, ``environ`` or ``fd``;
* ABI 6 and later: no signal to a process outside the domain (it cannot kill
  the daemon) and no abstract UNIX socket outside it.

Network access is left alone: UCX connects and listens over TCP. A kernel
without Landlock leaves the worker unrestricted; :func:`restrict` says so in
its answer and the supervisor logs it.
"""

from __future__ import annotations

import ctypes
import os
import sys

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # x86-64 and arm64 syscall numbers
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_FILE, MAKE_REG, TRUNCATE = 1 << 5, 1 << 8, 1 << 14
_FS_BITS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # ABI 5 on: 16 bits
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
READ_ONLY = EXECUTE | READ_FILE | READ_DIR
SHARED_MEMORY = READ_FILE | READ_DIR | WRITE_FILE | REMOVE_FILE | MAKE_REG | TRUNCATE
LIBRARY_DIRS = ("/usr", "/lib", "/lib64", "/sys")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def allowed_paths() -> list[tuple[str, int]]:
    """Where the worker may still go, and how."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if p)}
    paths = [(p, READ_ONLY) for p in sorted(prefixes | set(LIBRARY_DIRS))]
    return paths + [(f"/proc/{os.getpid()}", READ_ONLY), ("/dev/shm", SHARED_MEMORY),
                    ("/dev/null", READ_FILE | WRITE_FILE), ("/dev/urandom", READ_FILE)]


def restrict() -> str:
    """Restrict this process for good; what was done, in words (``landlock ABI n`` or ``off: why``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 1:
        return f"off: no Landlock in this kernel ({os.strerror(ctypes.get_errno())})"
    fs_bits = _FS_BITS_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(fs_bits, 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"off: landlock_create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    try:
        for path, access in allowed_paths():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                if not os.path.isdir(path):
                    access &= EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # directory rights do not apply to a file
                rule = _PathBeneathAttr(access & fs_bits, fd)
                if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    return f"off: landlock_add_rule({path}) failed ({os.strerror(ctypes.get_errno())})"
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"off: no_new_privs refused ({os.strerror(ctypes.get_errno())})"
        if libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            return f"off: landlock_restrict_self failed ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return f"landlock ABI {abi}"
