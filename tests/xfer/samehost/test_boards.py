"""Same-host board checks (issue #55 on #37): a reader that copies a holder's blocks itself maps the holder's
hold board too and checks holds by looking at it, not with NIXL READs; a hold that ends shows there."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from kvxferd.errors import TransferError
from kvxferd.plan.board import BoardInfo
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.boardmemory import BoardMemory
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.nixl.checks import CheckArea
from kvxferd.xfer.rankmachine import STALE_ERROR, UNHELD_ERROR
from kvxferd.xfer.samehost.boards import map_board

GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(*GROUPS, 2, 1, name="boards", same_host=True) as cluster:
        yield cluster


@pytest.fixture
def nixl_checks(monkeypatch):
    """How many board checks went out as NIXL READs."""
    posted = []
    real = CheckArea.post
    monkeypatch.setattr(CheckArea, "post", lambda self, *args, **kw: posted.append(1) or real(self, *args, **kw))
    return posted


def _request(request_id: str, seed: int):
    return random_request(request_id, *GROUPS, 48, np.random.default_rng(seed))


def test_a_same_host_read_checks_its_holds_on_the_mapped_board_and_posts_no_check_read(cluster, nixl_checks):
    cluster.connect()
    remote = cluster.executors[0].remote(cluster.prefill_id)
    assert all(rank.board is not None for rank in remote.host_ranks.values()) and len(remote.host_ranks) == 2
    assert remote.board_errors == {}
    request = _request("mapped", 1)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == [] and nixl_checks == []


def test_the_control_without_the_boards_share_the_checks_are_nixl_reads(cluster, nixl_checks):
    executor = cluster.executors[0]
    boards = [dataclasses.replace(holder.board, share=None) for holder in cluster.holders]
    executor.connect([e.cache for e in cluster.prefill], [a.metadata() for a in cluster.prefill_agents], boards,
                     same_host=True)
    remote = executor.remote(cluster.prefill_id)
    assert len(remote.host_ranks) == 2 and all(rank.board is None for rank in remote.host_ranks.values())
    assert set(remote.board_errors.values()) == {"the holder named no memory for its board"}
    request = _request("nixl-checked", 2)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == [] and len(nixl_checks) == 4  # two ranks, before and after
    cluster.connect()


def test_a_hold_that_ended_before_the_read_copies_nothing(cluster, nixl_checks):
    cluster.connect()
    request = cluster.hold(_request("ended-before", 3))
    for holder in cluster.holders:
        holder.holds.release(request.remote_request_id)
    cluster.reset_decode()
    (result,) = cluster.read(request, hold=False)
    assert not result.ok and result.failure is ReadFailure.STALE and UNHELD_ERROR in result.error
    assert cluster.check(request) != []  # nothing was copied: the oracle sees it (it can fail)
    assert nixl_checks == []


def test_a_hold_that_ends_during_the_copy_is_stale_and_its_blocks_invalid(cluster, nixl_checks):
    """The holder lets the hold go while the blocks are copied: the check after the copy sees the tag gone."""
    cluster.connect()
    request = cluster.hold(_request("ended-during", 4))
    remote = cluster.executors[0].remote(cluster.prefill_id)
    released = []
    for rank in remote.host_ranks.values():
        copy = rank.copier

        def releasing(*spans, copy=copy):
            if not released:  # the first rank's copy: every holder lets go meanwhile
                released.extend(holder.holds.release(request.remote_request_id) for holder in cluster.holders)
            return copy(*spans)
        rank.copier = releasing
    cluster.reset_decode()
    (result,) = cluster.read(request, hold=False)
    assert not result.ok and result.failure is ReadFailure.STALE and STALE_ERROR in result.error
    assert sum(len(ids) for ids in result.invalid_block_ids) == sum(len(ids) for ids in request.local_block_ids)
    assert nixl_checks == []
    cluster.connect()


def test_a_released_connection_unmaps_the_board_and_a_late_check_fails_instead_of_faulting(cluster):
    cluster.connect()
    remote = cluster.executors[0].remote(cluster.prefill_id)
    board = next(iter(remote.host_ranks.values())).board
    cluster.executors[0].release_host_memory(remote, "the holder changed")
    assert board.closed
    with pytest.raises(TransferError, match="unmapped"):
        board.holds(1)
    cluster.connect()


def test_a_board_is_mapped_only_from_the_holders_object_and_only_if_it_fits():
    memory, other = BoardMemory.create(64), BoardMemory.create(64)
    try:
        share = memory.share()
        memory.words[3, 5] = 77
        board = BoardInfo(memory.words.ctypes.data, 64, b"k" * 32, share)
        mapped = map_board(board)
        try:
            assert mapped.num_buckets == 64
        finally:
            mapped.close()
        with pytest.raises(TransferError, match="not the one the holder mapped"):  # another memfd's fd
            map_board(dataclasses.replace(board, share=dataclasses.replace(share, holder_fd=other.fd)))
        with pytest.raises(TransferError, match="does not lie inside"):
            map_board(dataclasses.replace(board, num_buckets=128))
        with pytest.raises(TransferError, match="no memfd of its own"):
            map_board(dataclasses.replace(board, share=None))
        with pytest.raises(TransferError, match="no memfd of its own"):  # a name: anyone's object
            map_board(dataclasses.replace(board, share=dataclasses.replace(share, name="kvxferd-board")))
        unsealed = os.memfd_create("kvxferd-unsealed")  # read with plain loads, it could shrink under them
        try:
            os.ftruncate(unsealed, memory.words.nbytes)
            status = os.fstat(unsealed)
            with pytest.raises(TransferError, match="not a memfd sealed against shrinking"):
                map_board(dataclasses.replace(board, share=dataclasses.replace(
                    share, holder_fd=unsealed, device=status.st_dev, inode=status.st_ino)))
        finally:
            os.close(unsealed)
        assert share.holder_pid == os.getpid() and share.name == ""
    finally:
        memory.close()
        other.close()


HOLDER = """
import time
from kvxferd.plan.board import HoldBoard
from kvxferd.xfer.boardmemory import BoardMemory
memory = BoardMemory.create(64)
HoldBoard(64, memory.words).add(4242)
share = memory.share()
print(share.holder_pid, share.holder_fd, share.device, share.inode, flush=True)
time.sleep(600)
"""


def test_a_board_whose_holder_exited_says_nothing():
    """The reader's mapping keeps a dead holder's board pages, every tag frozen: a check after the holder's
    process ended fails (its pidfd), where a READ of its gone agent would have failed too. The control: the
    same check while it lives sees the tag (and not another)."""
    import subprocess
    import sys

    from kvxferd.plan.board import BoardInfo, HostShare

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        pid, fd, device, inode = map(int, holder.stdout.readline().split())
        mapped = map_board(BoardInfo(1 << 20, 64, b"k" * 32, HostShare("", 0, device, inode, pid, fd)))
        try:
            assert mapped.holds(4242) and not mapped.holds(4243)
            holder.kill()
            holder.wait(10)
            with pytest.raises(TransferError, match="exited"):  # its pages live on here, the tag frozen
                mapped.holds(4242)
        finally:
            mapped.close()
    finally:
        holder.kill()
        holder.wait(10)


def test_without_pidfds_a_same_host_rank_is_still_copied_and_its_checks_are_nixl_reads(cluster, nixl_checks,
                                                                                        monkeypatch):
    """A kernel without pidfd_open (before 5.3): a board cannot be tied to its holder's life, so it is not
    mapped; the rank is still copied, its checks are NIXL READs (saying why), and the read is as exact."""
    def no_pidfds(pid):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    cluster.connect()
    remote = cluster.executors[0].remote(cluster.prefill_id)
    assert len(remote.host_ranks) == 2 and all(rank.board is None for rank in remote.host_ranks.values())
    assert all("no pidfd" in error for error in remote.board_errors.values()) and len(remote.board_errors) == 2
    request = _request("no-pidfd", 9)
    cluster.reset_decode()
    (result,) = cluster.read(request)
    assert result.ok and cluster.check(request) == [] and len(nixl_checks) == 4
    monkeypatch.undo()
    cluster.connect()


def test_a_pidfd_is_of_the_process_proc_names_and_only_while_it_lives():
    import subprocess
    import sys

    from kvxferd.xfer.samehost.opened import holder_pidfd

    own = holder_pidfd(os.getpid())
    os.close(own)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)  # reaped: its pid names nothing any more
    with pytest.raises(TransferError, match=f"process {child.pid}"):
        holder_pidfd(child.pid)
