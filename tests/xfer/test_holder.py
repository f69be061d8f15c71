"""The holder learns from readers' notices whether their READs need its progress (``kvxferd/xfer/holder.py``).

Over shared memory UCX copies inside the reader's post, so the reader's notice
says it read alone and the holder may poll slowly; over TCP (``UCX_TLS=tcp``)
every READ waits for the holder's progress, the notices say so, and the
holder wants fast polling. A reader speaks only for itself, and only an
introduced reader's notices count.
"""

import numpy as np
import pytest

from kvxferd.plan.notifications import ReadNotice
from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.holder import NoticeEvent, PROGRESS_WANTED_S, READER_SETUP_S, Reader

GROUPS = model_groups("gqa", ModelShape())


def _notices_of_reads(name: str, num_reads: int, *, stop_after_alone: int = 0) -> tuple[list[bool], bool]:
    """Read the same blocks up to ``num_reads`` times (1 -> 1), or until ``stop_after_alone`` notices in a
    row said the reader read alone: each notice's ``alone``, and whether the holder then wants progress."""
    prefill_groups, decode_groups = GROUPS
    with LocalCluster(prefill_groups, decode_groups, 1, 1, name=name) as cluster:
        holder = cluster.holders[0]
        heard: list[ReadNotice] = []
        real = holder.on_notice

        def counting(sender, message, now=None):
            if bytes(message[:2]) == b"KN":
                heard.append(ReadNotice.decode(message))
            return real(sender, message, now)

        holder.on_notice = counting
        for n in range(num_reads):
            request = random_request(f"{name}-{n}", prefill_groups, decode_groups, 48, np.random.default_rng(7))
            assert all(result.ok for result in cluster.read(request))
            assert cluster.holder_thread.wait_end(0, request.remote_request_id).kind == "CONSUMED"
            if stop_after_alone and [n.alone for n in heard[-stop_after_alone:]] == [True] * stop_after_alone:
                break
        return [notice.alone for notice in heard], holder.wants_progress()


def test_over_shared_memory_readers_read_alone_and_over_tcp_they_need_the_holder(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    alone, wanted = _notices_of_reads("shm", 20, stop_after_alone=3)
    # The first one or two READs of a new connection wait while UCX sets it up; then none do.
    assert alone[-3:] == [True, True, True] and not wanted, alone
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when the agents are created
    alone, wanted = _notices_of_reads("tcp", 3)
    assert alone == [False, False, False] and wanted


@pytest.fixture(scope="module")
def holder_and_reader():
    prefill_groups, decode_groups = GROUPS
    with LocalCluster(prefill_groups, decode_groups, 1, 1, name="speaks") as cluster:
        holder = cluster.holders[0]
        holder.introduce(("other", 0), Reader("other-notices", 1, 1), now=0.0)  # a second reader
        yield holder, cluster.executors[0].notices.name, cluster.decode_id


def test_a_reader_speaks_only_for_itself(holder_and_reader):
    holder, agent_name, decode_id = holder_and_reader
    holder.progress_wanted.clear()
    waited_before = holder.counts[NoticeEvent.WAITED]

    def notice(engine_id, *, ok=True, alone):
        return ReadNotice("never-held", engine_id, 0, 1, ok, alone).encode()

    now = 1000.0
    holder.on_notice(agent_name, notice(decode_id, alone=False), now)
    assert holder.wants_progress(now) and holder.wants_progress(now + PROGRESS_WANTED_S - 1)
    holder.on_notice("other-notices", notice("other", alone=True), now)  # another reader: not its entry
    holder.on_notice("mallory", notice(decode_id, alone=True), now)  # not the introduced agent: dropped
    holder.on_notice(agent_name, notice(decode_id, ok=False, alone=True), now)  # a failed read proves nothing
    assert holder.wants_progress(now + 1)
    holder.on_notice(agent_name, notice(decode_id, alone=True), now + 1)
    assert not holder.wants_progress(now + 1)
    holder.on_notice("mallory", notice(decode_id, alone=False), now)  # forged: cannot make us poll either
    assert not holder.wants_progress(now + 1)
    holder.on_notice("other-notices", notice("other", alone=False), now)
    assert holder.wants_progress(now + 1) and not holder.wants_progress(now + PROGRESS_WANTED_S + 1)
    assert holder.counts[NoticeEvent.WAITED] == waited_before + 2  # the two from introduced agents (kvxferd_waited_notices)


def test_a_new_reader_gets_fast_polls_until_it_reads_alone_and_one_that_never_reads_here_none(holder_and_reader):
    holder, agent_name, decode_id = holder_and_reader
    holder.progress_wanted.clear()
    reader = holder.readers.get((decode_id, 0))
    holder.introduce((decode_id, 0), reader, now=50.0)  # introduced again (a re-handshake)
    assert holder.wants_progress(50.0) and not holder.wants_progress(50.0 + READER_SETUP_S)
    holder.on_notice(agent_name, ReadNotice("never-held", decode_id, 0, 1, alone=True).encode(), 50.1)
    assert not holder.wants_progress(50.1)  # its first read went alone: the window ends early
    holder.introduce(("elsewhere", 3), Reader("elsewhere-notices", 4, 1), reads_here=False, now=60.0)
    assert not holder.wants_progress(60.0) and ("elsewhere", 3) in holder.readers


def test_a_notice_after_its_hold_ended_is_marked_late_for_its_writer_only(holder_and_reader):
    """A push's decode side waits for each writer's word that its WRITE is over, late or not (issue #57): a
    notice for a hold that is not held any more comes back as an unpublished FAILED/LATE_NOTICE event naming
    its sender's reader; from an agent not introduced for that reader, nothing."""
    from kvxferd.plan.leases import FAILED, LATE_NOTICE

    holder, agent_name, decode_id = holder_and_reader
    message = ReadNotice("never-held", decode_id, 0, 1, False, True).encode()
    (late,) = holder.on_notice(agent_name, message, 1000.0)
    assert (late.kind, late.reason, late.request_id, late.failed_readers) == (FAILED, LATE_NOTICE, "never-held",
                                                                            ((decode_id, 0),))
    assert holder.on_notice("mallory", message, 1000.0) == []  # not the introduced agent
    capability = holder.hold("held", (np.arange(2),), 30.0, 1000.0)  # a live hold: its notice counts, no marker
    live = ReadNotice("held", decode_id, 0, 1, True, True, capability=capability).encode()
    assert all(end.reason != LATE_NOTICE for end in holder.on_notice(agent_name, live, 1000.0))
