"""What a same-host holder names by its own fd, opened: by the reader itself, or for a reader worker by its daemon.

A holder names an object its engine passed as an fd (and its hold board, a
memfd) as ``/proc/<holder pid>/fd/<fd>``. A reader opens that link itself
(:func:`open_passed`). A reader worker cannot: its sandbox keeps it out of
every other process's ``/proc``. So its daemon opens each object, and a
pidfd of each holder whose board the worker maps, and sends them with the
``connect`` command (:class:`OpenedObjects`)::

    daemon (open_passed_objects)                  reader worker (OpenedObjects.of_message)
    /proc/<pid>/fd/<n> ─ checked, O_RDONLY ─ fd ─► mapped as if opened there
    pidfd_open(<pid>) ─ checked: the pid /proc named ─► polled before a board check is believed

A pidfd says when the holder's process is gone: its board's pages outlive it
in the reader's mapping, every tag frozen as it was, so a board whose holder
exited must not be read as holding anything.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import InvalidArgumentError, TransferError
from kvxferd.plan.groups import EngineCache, HostShare

# Where shared memory lives: tmpfs (/dev/shm, and memfds) and hugetlbfs. A passed fd naming anything else
# (a file on disk, a device) is refused before it is opened for reading.
TMPFS, HUGETLBFS = 0x01021994, 0x958458F6
SHM_FS_TYPES = frozenset({TMPFS, HUGETLBFS})
STATFS_BYTES = 256  # room for struct statfs, whose first member is f_type
MAX_ENTRIES = 253  # the kernel's SCM_MAX_FD: what one command carries, objects and pidfds together
_libc = ctypes.CDLL(None, use_errno=True)


def fs_type(fd: int) -> int:
    """The type of the filesystem ``fd``'s file lies on (``statfs``'s ``f_type``; -1 if unknown)."""
    buffer = ctypes.create_string_buffer(STATFS_BYTES)
    if _libc.fstatfs(fd, buffer) != 0:
        return -1
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


@dataclass
class OpenedObjects:
    """What another process opened for this one: by identity (``st_dev``, ``st_ino``) each object's fd, and
    by pid each holder's pidfd, or why it could not. Whoever opened them closes them (:meth:`close`)."""

    objects: dict[tuple[int, int], int | str] = field(default_factory=dict)
    pidfds: dict[int, int | str] = field(default_factory=dict)
    # GPU VMM allocations' fds by share token (fetched off the data-plane thread: vmmshare.fetch_shares);
    # never sent to a worker
    vmm_fds: dict[str, int | str] = field(default_factory=dict)
    partial: bool = False  # True: what is missing here is opened by the reader itself (the daemon's own reads)

    def object_fd(self, identity: tuple[int, int], name: str) -> int | None:
        """A duplicate of the object's fd (the caller's to close); :class:`TransferError` saying why not;
        None when this is ``partial`` and has none (the caller opens it)."""
        if self.partial and identity not in self.objects:
            return None
        return _dup(self.objects.get(identity, "the daemon did not open it for this process"),
                    f"cannot open shared-memory object {name!r}")

    def pidfd(self, pid: int) -> int | None:
        """A duplicate of the holder's pidfd (the caller's to close); :class:`TransferError` saying why not;
        None when this is ``partial`` and has none."""
        if self.partial and pid not in self.pidfds:
            return None
        return _dup(self.pidfds.get(pid, "the daemon did not open it for this process"), f"no pidfd of process {pid}")

    def vmm_fd(self, token: str) -> int | None:
        """A duplicate of a VMM allocation's fd (the caller's to close), :class:`TransferError` saying why
        not, or None when none was fetched for it."""
        if token not in self.vmm_fds:
            return None
        return _dup(self.vmm_fds[token], "cannot fetch the holder's GPU memory")

    def close(self) -> None:
        for fd in (*self.objects.values(), *self.pidfds.values(), *self.vmm_fds.values()):
            if isinstance(fd, int):
                os.close(fd)
        self.objects, self.pidfds, self.vmm_fds = {}, {}, {}

    def message(self) -> tuple[dict, list[int]]:
        """As a command carries it, and the fds to send with it: ``[device, inode, fd index or why not]`` per
        object, ``[pid, fd index or why not]`` per pidfd; beyond what one command carries, a reason."""
        fds: list[int] = []

        def entry(given: int | str) -> int | str:
            if isinstance(given, str):
                return given
            if len(fds) == MAX_ENTRIES:
                return "more objects than one command carries"
            fds.append(given)
            return len(fds) - 1
        pidfds = [[pid, entry(given)] for pid, given in list(self.pidfds.items())[:MAX_ENTRIES]]  # (few: first)
        objects = [[device, inode, entry(given)] for (device, inode), given in list(self.objects.items())[:MAX_ENTRIES]]
        return {"objects": objects, "pidfds": pidfds}, fds

    @classmethod
    def of_message(cls, message: Any, fds: Sequence[int]) -> "OpenedObjects | None":
        """:meth:`message` read back against the fds that came with it (they stay the caller's); None for
        none. :class:`InvalidArgumentError` for anything else."""
        if message is None:
            return None
        if not isinstance(message, dict):
            raise InvalidArgumentError("objects", "an object")
        opened = cls()
        for key, width, into in (("objects", 3, opened.objects), ("pidfds", 2, opened.pidfds)):
            entries = message.get(key, [])
            if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
                raise InvalidArgumentError(key, f"a list of at most {MAX_ENTRIES}")
            for e in entries:
                if not (isinstance(e, list) and len(e) == width and all(_is_int(v) for v in e[:-1])
                        and (isinstance(e[-1], str) or _is_int(e[-1]) and 0 <= e[-1] < len(fds))):
                    raise InvalidArgumentError(key, "[identity..., fd index or reason] each")
                into[tuple(e[:-1]) if width == 3 else e[0]] = fds[e[-1]] if _is_int(e[-1]) else e[-1][:300]
        return opened


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dup(given: int | str, what: str) -> int:
    if isinstance(given, str):
        raise TransferError("same_host", f"{what}: {given}")
    try:
        return os.dup(given)
    except OSError as err:  # out of fds
        raise TransferError("same_host", f"{what}: {err.strerror}") from None


def open_passed_objects(remotes: Sequence[EngineCache], boards: Sequence = ()) -> OpenedObjects:
    """Every shared-memory object the holders named by their fd (their engines' regions, their hold
    ``boards``), opened here read-only for a process that cannot open it itself (a reader worker,
    sandboxed), and a pidfd of each holder whose board it maps: each, or why it could not be opened (then
    that rank reads, or its board is checked, over NIXL). Checked as the reader itself checks them."""
    opened = OpenedObjects()
    shares = {r.share for cache in remotes if cache.mem_type == "DRAM" for memory in cache.memory for r in memory}
    board_shares = {b.share for b in boards if b is not None and isinstance(b.share, HostShare)}
    try:
        # Pidfds first: an object opened later through /proc/<pid> while that pidfd's process lives is that
        # process's (had the holder died between, and its pid gone to another process, the pidfd would be
        # the other's, which lives on: a dead holder's frozen board would pass for live).
        for pid in {share.holder_pid for share in board_shares}:
            try:
                opened.pidfds[pid] = holder_pidfd(pid)
            except TransferError as err:
                opened.pidfds[pid] = err.message
        for share in shares | board_shares:
            if not isinstance(share, HostShare) or share.name or (share.device, share.inode) in opened.objects:
                continue
            try:
                opened.objects[(share.device, share.inode)] = open_passed(share)
            except TransferError as err:
                opened.objects[(share.device, share.inode)] = err.message
    except BaseException:
        opened.close()
        raise
    return opened


def proc_of(pid: int) -> int:
    """``/proc/<pid>`` held open (a reused pid cannot stand in for it meanwhile), for a process of this
    user only: a root reader must not open another user's files for a holder."""
    try:
        proc = os.open(f"/proc/{int(pid)}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        proc = -1
    if proc < 0 or os.fstat(proc).st_uid != os.geteuid():
        if proc >= 0:
            os.close(proc)
        raise TransferError("same_host", f"process {pid} is not one of this user's (another PID namespace, or gone)")
    return proc


def holder_pidfd(pid: int) -> int:
    """A pidfd of the holder's process (readable once it exited): of the process ``/proc/<pid>`` names
    while it is held open, so not of a process that took over a reused pid."""
    proc = proc_of(pid)
    try:
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError) as err:  # gone; a kernel before 5.3
            raise TransferError("same_host", f"no pidfd of process {pid}: {err}") from None
        try:
            os.close(os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc))  # still the process /proc named
            with open(f"/proc/self/fdinfo/{pidfd}") as info:  # and /proc's pid namespace is this process's
                named = [line.split()[1] for line in info if line.startswith("Pid:")]
        except (OSError, IndexError):
            os.close(pidfd)
            raise TransferError("same_host", f"process {pid} exited") from None
        if named != [str(pid)]:
            os.close(pidfd)
            raise TransferError("same_host", f"process {pid} is another PID namespace's (its pidfd names {named})")
        return pidfd
    finally:
        os.close(proc)


def open_passed(share: HostShare, *, writable: bool = False) -> int:
    """The holder's copy of an fd its engine passed, opened read-only here (``writable``: read-write, for a
    push into it). Nothing is opened for reading
    before it is known to be the object the holder mapped: the process must be this user's (its /proc
    directory held open, so a reused pid cannot stand in), the link is followed with ``O_PATH`` (no
    driver's open runs), and the file must be a regular file in shared memory with the holder's
    ``st_dev``/``st_ino``; then it is reopened from that ``O_PATH`` fd."""
    identity, name = (share.device, share.inode), share.path
    proc = proc_of(share.holder_pid)
    try:
        try:
            handle = os.open(f"fd/{int(share.holder_fd)}", os.O_PATH | os.O_CLOEXEC, dir_fd=proc)
        except OSError as err:
            raise TransferError("same_host", f"cannot open shared-memory object {name!r}: {err.strerror}") from None
    finally:
        os.close(proc)
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode) or fs_type(handle) not in SHM_FS_TYPES:
            raise TransferError("same_host", f"{name!r} is not a shared-memory object (a regular file on tmpfs or "
                                             "hugetlbfs)")
        if (status.st_dev, status.st_ino) != identity:
            raise TransferError("same_host", f"shared-memory object {name!r} is not the one the holder mapped")
        try:
            return os.open(f"/proc/self/fd/{handle}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC |
                           os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as err:  # its mode does not let this user read it (an engine of another user)
            raise TransferError("same_host", f"cannot open shared-memory object {name!r}: {err.strerror}") from None
    except OSError as err:  # fstat of an O_PATH fd: out of memory
        raise TransferError("same_host", f"cannot open shared-memory object {name!r}: {err.strerror}") from None
    finally:
        os.close(handle)
