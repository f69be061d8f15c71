"""Open the memory an engine hands over, so NIXL can register it.

Host memory arrives as the name of a POSIX shared-memory object, or as its
fd passed over the fd socket. The daemon maps it read-write
(``/dev/shm/<name>``) and keeps the mapping until the engine deregisters.

A name is opened with the daemon's credentials, so it is opened only for an
object every user who could have sent the ``Register`` could open
read-write itself (:class:`ShmOpeners`): with the engine socket 0600 only
the daemon's user and root connect, and whatever the daemon can open, they
could; with ``engine_socket_group`` the object must be readable and
writable by that group (its group, ``g+rw``) or by everyone (``o+rw``);
over ``engine_tcp`` by everyone; for each of ``allowed_uids`` (the sockets'
ACLs admit them) the object must be that uid's own (``u+rw``) or everyone's.
Else ``PERMISSION_DENIED`` (also for an object the daemon's own user cannot
open: before, ``INVALID_ARGUMENT``): an engine
passes such an object as an fd (``shm_fd_index``), which proves it opened
it. (Before, a group member named a root-only object of a root daemon and
read it over NIXL.) An object with a POSIX ACL is refused in the last two
cases: its mode bits do not say who may open it.

It deliberately avoids
``multiprocessing.shared_memory``: in Python < 3.13 that registers even an
attached segment with the resource tracker, which would unlink the engine's
cache when the daemon exits.

Each page of a fresh mapping faults the first time a read touches it (in
the reader's copy, or in the holder's pages the reader's kernel pins): about
1 µs a page, which doubled the first reads of a new registration here.
:func:`populate` faults them all in at registration instead.

GPU memory (CUDA IPC handles, CUDA VMM fds) is opened by
:mod:`kvxferd.service.engines.gpu`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.cuda.ipc import resolve_device
from kvxferd.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from kvxferd.plan.groups import HostShare, RegionMemory
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.engines import gpu
from kvxferd.wire.names import shm_path

log = logging.getLogger(__name__)


@dataclass(eq=False)
class MappedRegion:
    """One mapped region: its bytes (a numpy view) and where they live."""

    name: str
    array: np.ndarray  # uint8 view of the region
    _mapping: mmap.mmap = field(repr=False)
    share: HostShare | None = None  # what a same-host reader opens the object by (its name, or our fd copy)
    fd: int = -1  # a copy of the object's fd, kept for a data-plane worker to map (docs/dataplane.md)
    fd_offset: int = 0  # where the region starts in it

    @property
    def memory(self) -> RegionMemory:
        return RegionMemory(self.array.ctypes.data, self.array.nbytes, share=self.share)

    def close(self) -> None:
        """Unmap (after NIXL deregistered it; no view may outlive this)."""
        self.array = np.zeros(0, dtype=np.uint8)
        self._mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_ACL_XATTR = "system.posix_acl_access"


@dataclass(frozen=True)
class ShmOpeners:
    """Who may have sent a ``Register``: who must be able to open a shm object it names."""

    group: int | None = None  # engine_socket_group: its members connect too (else the daemon's user and root)
    anyone: bool = False  # the call came over engine_tcp: anyone holding the token
    uids: frozenset[int] = frozenset()  # allowed_uids: the sockets' ACLs admit them too

    def check(self, fd: int, status: os.stat_result, name: str, field: str) -> None:
        """Refuse (``PERMISSION_DENIED``) an object some possible sender could not open read-write itself."""
        mode = stat.S_IMODE(status.st_mode)
        for uid in self.uids - {os.getuid(), 0}:
            # Certain only for its owner (the owner's bits apply to it whatever else the object says) or for
            # an object every class may open, without an ACL that could name this uid: the groups of
            # another uid are not ours to know (a pod's supplementary groups are in no /etc/group here).
            if not ((status.st_uid == uid and mode & 0o600 == 0o600) or (mode & 0o666 == 0o666 and not _has_acl(fd))):
                raise PermissionDeniedError(f"{field}.shm_name", f"shared-memory object {name!r} (uid "
                                            f"{status.st_uid}, mode {mode:04o}) is neither uid {uid}'s own "
                                            "(allowed_uids) nor readable and writable by everyone: the daemon opens "
                                            "a name only for an object every user it admits could open itself; "
                                            "pass it as an fd (handle.shm_fd_index) instead")
        if self.group is None and not self.anyone:
            return  # the daemon's user and root: the daemon just opened it as that user
        # Linux takes the first class that matches (owner, then group, then other), so a user of an earlier
        # class is not granted what a later one says: every class a possible sender falls in must allow rw.
        everyone = mode & 0o666 == 0o666
        group = not self.anyone and status.st_gid == self.group and mode & 0o660 == 0o660
        if (everyone or group) and not _has_acl(fd):
            return
        who = "everyone (it came over engine_tcp)" if self.anyone else f"group {self.group} (engine_socket_group)"
        raise PermissionDeniedError(f"{field}.shm_name", f"shared-memory object {name!r} (uid {status.st_uid}, gid "
                                    f"{status.st_gid}, mode {mode:04o}{', an ACL' if group or everyone else ''}) "
                                    f"is not readable and writable by {who}: the daemon opens a name only for an "
                                    "object every user it admits could open itself; pass it as an fd "
                                    "(handle.shm_fd_index) instead")


def _has_acl(fd: int) -> bool:
    try:
        return _ACL_XATTR in os.listxattr(fd)
    except OSError:  # no extended attributes here: no ACL either
        return False


MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it before 3.13
_PAGE_BYTES = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def populate(regions: Sequence[object]) -> int:
    """Fault in every page of these host mappings now, in this process's page tables; the bytes done.

    One ``madvise(MADV_POPULATE_WRITE)`` per region, through ctypes, which
    lets go of the GIL for the call (about 0.2 ms per MiB here). GPU regions
    are skipped; so is everything on a kernel without it (``EINVAL``): reads
    then fault their pages in as before.
    """
    num_bytes = 0
    for region in regions:
        if not isinstance(region, MappedRegion) or not region.array.nbytes:
            continue
        start = region.array.ctypes.data // _PAGE_BYTES * _PAGE_BYTES
        length = region.array.ctypes.data + region.array.nbytes - start
        if _libc.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() == errno.EINVAL:
                return num_bytes
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        num_bytes += region.array.nbytes
    return num_bytes


def map_shm(name: str, offset: int, num_bytes: int, field: str,
            openers: ShmOpeners = ShmOpeners(), *, keep_fd: bool = False) -> MappedRegion:
    """Map ``num_bytes`` at ``offset`` of shared-memory object ``name``, if ``openers`` could open it themselves;
    ``keep_fd``: the region keeps a copy of the object's fd (for a data-plane worker)."""
    path = shm_path(name, field)
    if offset < 0 or num_bytes <= 0:
        raise InvalidArgumentError(field, f"bad range: offset {offset}, {num_bytes} bytes")
    try:
        # O_NOFOLLOW: a symlink in /dev/shm must not expose a file from elsewhere over NIXL.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFoundError(f"{field}.shm_name", f"no shared-memory object {name!r}") from None
    except PermissionError:  # the daemon's own user may not open it: a question of who, not of the request
        raise PermissionDeniedError(f"{field}.shm_name", f"shared-memory object {name!r} is not readable and "
                                                         "writable by the daemon's user; pass it as an fd "
                                                         "(handle.shm_fd_index) instead") from None
    except OSError as err:  # ELOOP (a symlink), EISDIR, ...: the name, never the server's path
        raise InvalidArgumentError(f"{field}.shm_name", f"cannot open shared-memory object {name!r}: "
                                                         f"{err.strerror or type(err).__name__}") from None
    try:
        status = os.fstat(fd)
        openers.check(fd, status, name, field)  # the object opened, not whatever the name means by now
        region = _map_open_fd(fd, name, offset, num_bytes, field)
        region.share = HostShare(name, offset, status.st_dev, status.st_ino)
        if keep_fd:
            region.fd, region.fd_offset = os.dup(fd), offset
        return region
    finally:
        os.close(fd)


class KeptFds:
    """Copies of the fds an engine passed, one per fd, kept open while its registration lives: a same-host
    reader opens one as ``/proc/<this pid>/fd/<copy>`` (issue #37). Closed with the mappings."""

    def __init__(self) -> None:
        self.copies: dict[int, int] = {}  # the engine's fd (as received) -> our copy

    def copy_of(self, fd: int) -> int:
        """Our copy of ``fd`` (made once); raises :class:`OSError` (EMFILE: no fd left)."""
        if fd not in self.copies:
            self.copies[fd] = os.dup(fd)  # O_CLOEXEC: no child inherits it
        return self.copies[fd]

    def close(self) -> None:
        while self.copies:
            with contextlib.suppress(OSError):  # one that fails does not keep the others open
                os.close(self.copies.popitem()[1])


def map_fd(fd: int, offset: int, num_bytes: int, field: str, kept: KeptFds | None = None, *,
           keep_fd: bool = False) -> MappedRegion:
    """Map ``num_bytes`` at ``offset`` of a shared-memory fd the engine passed (the caller keeps ``fd``).
    With ``kept``, a copy of the fd stays open and the region records it for same-host readers;
    ``keep_fd``: the region keeps a copy of its own (for a data-plane worker)."""
    if offset < 0 or num_bytes <= 0:
        raise InvalidArgumentError(field, f"bad range: offset {offset}, {num_bytes} bytes")
    region = _map_open_fd(fd, f"fd {fd}", offset, num_bytes, f"{field}.handle.shm_fd_index")
    if keep_fd:
        region.fd, region.fd_offset = os.dup(fd), offset
    if kept is not None:
        try:
            copy = kept.copy_of(fd)
        except OSError as err:  # no fd left: this region is read over NIXL, the registration goes on
            log.warning("cannot keep a copy of a passed fd for same-host readers: %s", err.strerror)
        else:
            status = os.fstat(copy)
            region.share = HostShare("", offset, status.st_dev, status.st_ino, os.getpid(), copy)
    return region


def _map_open_fd(fd: int, name: str, offset: int, num_bytes: int, field: str) -> MappedRegion:
    try:
        status = os.fstat(fd)
    except OSError as err:
        raise InvalidArgumentError(field, f"cannot use {name}: {err.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise InvalidArgumentError(field, f"{name!r} is not a shared-memory object (not a regular file)")
    size = status.st_size
    if offset + num_bytes > size:
        raise InvalidArgumentError(field, f"region [{offset}, {offset + num_bytes}) exceeds {name!r} of {size} bytes")
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as err:  # opened read-only, or not mappable
        raise InvalidArgumentError(field, f"cannot map {name!r} read-write: {err.strerror}") from None
    array = np.frombuffer(mapping, dtype=np.uint8, count=num_bytes, offset=offset)
    return MappedRegion(name, array, mapping)


def open_region(region: pb.Region, num_bytes: int, mem_type: str, field: str, fds: Sequence[int] = (),
                openers: ShmOpeners = ShmOpeners(), kept: KeptFds | None = None, *, keep_fd: bool = False,
                vmm_offers=None):
    """Open one region of a Register request; returns an object with ``memory`` and ``close()``.
    ``openers``: who may have sent it (a ``shm_name`` is opened only for an object they could open);
    ``kept``: where copies of passed shared-memory fds stay open for same-host readers; ``keep_fd``: a host
    region keeps a copy of its object's fd (:attr:`MappedRegion.fd`) for a data-plane worker;
    ``vmm_offers``: a :class:`~kvxferd.service.engines.gpu.VmmOffers`, which offers a VMM region's
    allocation to same-host readers."""
    source = region.handle.WhichOneof("source")
    want = {"shm_name": "DRAM", "shm_fd_index": "DRAM", "cuda_ipc_handle": "VRAM", "cuda_vmm_fd_index": "VRAM"}.get(source)
    if source is None:
        raise InvalidArgumentError(f"{field}.handle", "a region needs a memory handle")
    if mem_type != want:
        raise InvalidArgumentError(f"{field}.handle.{source}", f"a {source} handle is {want} memory, the engine says {mem_type}")
    offset = region.handle.offset
    if source == "shm_name":
        return map_shm(region.handle.shm_name, offset, num_bytes, field, openers, keep_fd=keep_fd)
    if source == "shm_fd_index":
        index = region.handle.shm_fd_index
        if not 0 <= index < len(fds):
            raise InvalidArgumentError(f"{field}.handle.shm_fd_index", f"index {index}, {len(fds)} fds were sent")
        return map_fd(fds[index], offset, num_bytes, field, kept, keep_fd=keep_fd)
    device_id = resolve_device(region.device_id, region.device_uuid, field)
    if source == "cuda_ipc_handle":
        return gpu.open_ipc(region.handle.cuda_ipc_handle, offset, num_bytes, device_id, field, region.device_uuid)
    index = region.handle.cuda_vmm_fd_index
    if not 0 <= index < len(fds):
        raise InvalidArgumentError(f"{field}.handle.cuda_vmm_fd_index", f"index {index}, {len(fds)} fds were sent")
    mapping = gpu.import_vmm(os.dup(fds[index]), offset, num_bytes, device_id, field,
                             allocation_bytes=region.handle.allocation_bytes, rdma_capable=region.handle.rdma_capable)
    try:
        device_uuid = region.device_uuid or gpu.uuid_of(device_id, field)
        if vmm_offers is not None and device_uuid:  # same-host readers map it themselves (issue #56)
            vmm_offers.share(mapping, index, lambda: os.dup(fds[index]), device_uuid)
    except BaseException:
        mapping.close()
        raise
    return mapping
