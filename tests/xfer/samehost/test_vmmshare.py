"""Same-host reads of a holder's GPU VMM memory (issue #56): the reader fetches the allocation's fd from the
holder's fd socket with the token the holder gave it, maps it, and copies the planned spans.

The holder's memory is a played VMM allocation (a memfd, mapped for real) holding the prefill engine's
bytes; the fd travels over a real FdInbox socket by SCM_RIGHTS; the reads are checked byte for byte by the
oracle. The controls: a withdrawn share and a wrong token are refused, and the rank goes over NIXL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets

import numpy as np
import pytest

from kvxferd.client.gpu import export_vmm
from kvxferd.cuda.copies import BatchCopier
from kvxferd.cuda.vmm import ShareableAllocator
from kvxferd.errors import TransferError
from kvxferd.plan.groups import VmmShare
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.service.engines.fdpass import FdInbox
from kvxferd.wire.messages import engine_to_pb, peer_memory_from_pb
from kvxferd.xfer.samehost import devicemaps, ranks as samehostranks, vmmshare
from kvxferd.xfer.samehost.ranks import SameHostOpener
from tests.cuda.fake_driver import FakeDriver
from tests.cuda.vmm_driver import PlayedVmmDriver
from tests.xfer.samehost.test_devicemaps import GROUPS, LOCAL_GPU, UUID, _device_cache, _request


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(*GROUPS, 2, 1, name="vmmshare") as cluster:
        yield cluster


@pytest.fixture
def holder(tmp_path):
    """The holder's side: each prefill rank's bytes in a played VMM allocation, offered on a real fd socket."""
    vmm = PlayedVmmDriver()
    inbox = FdInbox(str(tmp_path / "holder.sock.fds"))
    allocator = ShareableAllocator(0, vmm)
    yield vmm, inbox, allocator
    inbox.close()


def _shared_cache(engine, vmm, inbox, allocator) -> tuple:
    """``engine``'s cache as a same-host holder names it when its memory is VMM: a share per allocation."""
    arena = engine.arena
    address = allocator.allocate(arena.nbytes)
    ctypes.memmove(address, arena.ctypes.data, arena.nbytes)
    export = export_vmm(address, arena.nbytes, lib=vmm)
    token = secrets.token_hex(16)
    inbox.offer(token, export.vmm_fd)
    share = VmmShare(token, inbox.path, os.getpid(), 0, export.allocation_bytes, UUID)
    memory = tuple(tuple(dataclasses.replace(r, share=dataclasses.replace(share, offset=r.address - arena.ctypes.data),
                                             device_id=LOCAL_GPU) for r in regions) for regions in engine.cache.memory)
    return dataclasses.replace(engine.cache, memory=memory, mem_type="VRAM"), token, export.vmm_fd


def test_vmm_share_survives_peer_info(cluster):
    """What a holder names in same-host peer info is what the reader gets back; a malformed one is dropped
    (that region is read over NIXL, the handshake stands)."""
    engine = cluster.prefill[0]
    share = VmmShare("ab" * 16, "/run/kvxferd/gpu0.sock.fds", 4242, 0, engine.arena.nbytes + (1 << 21), UUID)
    memory = tuple(tuple(dataclasses.replace(r, share=dataclasses.replace(share, offset=r.address - engine.arena.ctypes.data))
                         for r in regions) for regions in engine.cache.memory)
    cache = dataclasses.replace(engine.cache, memory=memory, mem_type="VRAM")
    message = engine_to_pb(cache, with_addresses=True, with_shares=True)
    assert peer_memory_from_pb(message)[0][0].share == memory[0][0].share
    for field, value in [("share_token", "not-hex"), ("share_socket", "relative/path"), ("holder_pid", 0),
                         ("allocation_bytes", 16)]:
        bad = type(message)()
        bad.CopyFrom(message)
        setattr(bad.groups[0].regions[0].handle, field, value)
        assert peer_memory_from_pb(bad)[0][0].share is None


def test_vmm_share_read_byte_exact_through_the_fetched_fd(cluster, holder, monkeypatch):
    vmm, inbox, allocator = holder
    driver = FakeDriver(lag=2)
    cluster.connect()
    monkeypatch.setattr(samehostranks, "BatchCopier", lambda device_id: BatchCopier(device_id, lib=driver))
    fetched = []

    def open_share(share, device_id, **kwargs):
        fetched.append(share.token)
        return vmmshare.open_vmm_share(share, device_id, lib=vmm, **kwargs)  # the real socket, the played import

    monkeypatch.setattr(devicemaps, "open_vmm_share", open_share)
    executor = cluster.executors[0]
    opener = SameHostOpener(_device_cache(executor.cache, 0, b""))
    remote = executor.remote(cluster.prefill_id)
    tokens = []
    for rank_plan in remote.plan.rank_plans:
        cache, token, _fd = _shared_cache(cluster.prefill[rank_plan.remote_rank], vmm, inbox, allocator)
        tokens.append(token)
        remote.host_ranks[rank_plan.remote_rank], _ = opener.open(cache, rank_plan)
    assert fetched == tokens  # one fetch per allocation, not per region
    before = executor.num_host_copies
    request = _request("vmm", 11)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == []
    assert executor.num_host_copies == before + 2
    opener.close()
    cluster.connect()


def test_vmm_share_answer_bound_is_the_fd_sockets():
    from kvxferd.wire.names import FD_ANSWER_MAX_BYTES
    assert vmmshare.ANSWER_MAX_BYTES == FD_ANSWER_MAX_BYTES


def test_vmm_share_control_withdrawn_or_wrong_token_is_refused(cluster, holder):
    vmm, inbox, allocator = holder
    cache, token, _fd = _shared_cache(cluster.prefill[0], vmm, inbox, allocator)
    share = cache.memory[0][0].share
    refused = []
    inbox.on_refused = refused.append
    with pytest.raises(TransferError, match="did not share"):
        vmmshare.fetch_fd(dataclasses.replace(share, token="00" * 16))
    fd = vmmshare.fetch_fd(share)
    assert os.fstat(fd).st_ino == os.fstat(_fd).st_ino  # the allocation's own fd, not a copy of its bytes
    os.close(fd)
    inbox.withdraw(token)
    with pytest.raises(TransferError, match="did not share"):
        vmmshare.fetch_fd(share)
    assert refused == ["share", "share"]
    copier = BatchCopier(LOCAL_GPU, lib=FakeDriver())
    with pytest.raises(TransferError, match="did not share"):  # so the rank is read over NIXL
        devicemaps.map_device_source(cache, copier, open_vmm=lambda s, d: vmmshare.open_vmm_share(s, d, lib=vmm))
    copier.close()


def test_vmm_share_offered_by_the_holder_until_its_last_mapping_closes(holder):
    """The holder's side (engines/gpu.VmmOffers): two regions of one allocation name one share, which its fd
    socket serves until the second mapping closes (deregistration), then withdraws; the reader fetches it
    once for both (fetch_shares, before connecting)."""
    from kvxferd.service.engines.gpu import VmmOffers, import_vmm

    vmm, inbox, allocator = holder
    address = allocator.allocate(1 << 21)
    export = export_vmm(address, 1 << 21, lib=vmm)
    offers, mappings = VmmOffers(inbox), []
    for offset in (4096, 65536):
        mapping = import_vmm(os.dup(export.vmm_fd), offset, 8192, 0, "r", allocation_bytes=export.allocation_bytes,
                             lib=vmm)
        offers.share(mapping, 0, lambda: os.dup(export.vmm_fd), UUID)
        mappings.append(mapping)
    first, second = (m.memory.share for m in mappings)
    assert isinstance(first, VmmShare) and first.token == second.token and (first.offset, second.offset) == (4096, 65536)
    assert (first.allocation_bytes, first.holder_pid, first.socket_path) == (1 << 21, os.getpid(), inbox.path)
    assert first.token not in repr(first)
    from kvxferd.plan.groups import EngineCache
    remote = EngineCache.__new__(EngineCache)
    object.__setattr__(remote, "mem_type", "VRAM")
    object.__setattr__(remote, "memory", ((m.memory for m in mappings),))
    fetched = vmmshare.fetch_shares([remote])
    assert list(fetched) == [first.token] and isinstance(fetched[first.token], int)
    os.close(fetched[first.token])
    mappings[0].close()
    os.close(vmmshare.fetch_fd(first))  # the other region still maps it: still served
    mappings[1].close()
    with pytest.raises(TransferError, match="did not share"):
        vmmshare.fetch_fd(first)
    assert not offers.offered
    os.close(export.vmm_fd)


def test_vmm_share_reader_checks_who_answers(holder, tmp_path):
    """The reader never connects by the bare path, only through the holder's /proc root, to an fd socket, and
    only the holder itself may answer: a share naming another process, or another kind of socket, is refused."""
    _vmm, inbox, _allocator = holder
    share = VmmShare("ab" * 16, inbox.path, os.getpid(), 0, 1 << 21, UUID)
    with pytest.raises(TransferError, match="not an fd socket"):
        vmmshare.fetch_fd(dataclasses.replace(share, socket_path="/run/elsewhere.sock"))
    with pytest.raises(TransferError, match="not one of this user's"):
        vmmshare.fetch_fd(dataclasses.replace(share, holder_pid=1 << 22))
    parent = os.getppid()
    if os.path.exists(f"/proc/{parent}") and os.stat(f"/proc/{parent}").st_uid == os.geteuid():
        # the parent's root is ours too: the socket is found, but the parent is not who answers there
        with pytest.raises(TransferError, match="not the holder"):
            vmmshare.fetch_fd(dataclasses.replace(share, holder_pid=parent))


def test_vmm_share_fetched_before_connecting_is_the_one_mapped(cluster, holder):
    """The daemon fetches the fds off the data-plane thread (fetch_shares) and connects with them: the map
    uses the prefetched fd, not the socket (withdrawn meanwhile here), and a failed fetch is the rank's reason."""
    from kvxferd.xfer.samehost.opened import OpenedObjects

    vmm, inbox, allocator = holder
    cache, token, _fd = _shared_cache(cluster.prefill[0], vmm, inbox, allocator)
    opened = OpenedObjects(partial=True, vmm_fds=vmmshare.fetch_shares([cache]))
    inbox.withdraw(token)
    copier = BatchCopier(LOCAL_GPU, lib=FakeDriver())
    open_vmm = lambda share, device, **kwargs: vmmshare.open_vmm_share(share, device, lib=vmm, **kwargs)  # noqa: E731
    source = devicemaps.map_device_source(cache, copier, open_vmm=open_vmm, opened=opened)
    source.close()
    failed = OpenedObjects(partial=True, vmm_fds=vmmshare.fetch_shares([cache]))  # withdrawn: refused now
    assert "did not share" in failed.vmm_fds[token]
    with pytest.raises(TransferError, match="did not share"):
        devicemaps.map_device_source(cache, copier, open_vmm=open_vmm, opened=failed)
    opened.close()
    failed.close()
    copier.close()
