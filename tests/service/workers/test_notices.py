"""The executor's notice agent in the worker (WorkerNotices): a holder hears the notices from the worker's
notice agent; references are counted here (the last removal unloads, and a notice then reaches nobody);
a new generation loads every holder still referenced again and its notices go on. Notices are batched:
sent at the first poll after the oldest waited NOTICE_BATCH_S, in order, one message for many."""

from __future__ import annotations

import json
import os
import signal
import time
import types

import pytest

from kvxferd.service.workers import notices as notices_module
from kvxferd.service.workers.notices import NOTICE_BATCH_S, WorkerNotices
from kvxferd.service.workers.generation import Region
from kvxferd.service.workers.supervisor import WorkerSupervisor
from kvxferd.xfer.nixl.agent import NixlAgent, agent_name_of


GRACE_S = 15.0  # a replaced generation serves this long after its successor is up (the test works meanwhile)


@pytest.fixture
def notices():
    fd = os.memfd_create("kvx-test-cache")
    os.ftruncate(fd, 1 << 16)
    supervisor = WorkerSupervisor("kvx-test-nw", [Region(fd, 1 << 16)], on_up=lambda up: proxy.reload(up),
                                  retire_grace_s=GRACE_S, min_replace_interval_s=0.0)
    proxy = WorkerNotices(supervisor)
    supervisor.start()
    holder = NixlAgent("kvx-test-holder")
    yield proxy, holder
    holder.close()
    supervisor.stop()
    os.close(fd)


def heard(holder: NixlAgent, wait_s: float, proxy: WorkerNotices, count: int = 1) -> list[tuple[str, bytes]]:
    """What the holder heard within ``wait_s``, once ``count`` came (it polls, as a holder does; the
    proxy is polled as the daemon's executor and data-plane thread poll it)."""
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        proxy.poll_notifications()
        got += holder.new_messages()
        if len(got) >= count:
            return got
        time.sleep(0.005)
    return got


def test_notices_come_from_the_workers_notice_agent_and_stop_at_the_last_removal(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    assert proxy.add_remote(holder.metadata()) == name  # a second connection to the same holder: counted
    proxy.connect_to(name)
    sender = agent_name_of(proxy.metadata())
    proxy.notify(name, b"n1")
    assert heard(holder, 10, proxy) == [(sender, b"n1")]
    proxy.remove_remote(name)  # one reference left: still loaded
    proxy.notify(name, b"n2")
    assert heard(holder, 10, proxy) == [(sender, b"n2")]
    proxy.remove_remote(name)  # the last: unloaded in the worker
    proxy.notify(name, b"n3")
    assert heard(holder, 1.0, proxy) == []


def test_a_new_generation_loads_every_referenced_holder_again(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    first = proxy.supervisor.current
    os.kill(first.pid, signal.SIGKILL)
    second = proxy.supervisor.wait_up(2, 30)
    proxy.notify(name, b"after")
    assert heard(holder, 10, proxy) == [(agent_name_of(second.notices_metadata), b"after")]
    assert agent_name_of(second.notices_metadata) != agent_name_of(first.notices_metadata)


def test_notices_wait_for_each_other_and_go_as_one_batch_in_order(notices, monkeypatch):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    proxy.connect_to(name)
    sender = agent_name_of(proxy.metadata())
    messages = []
    send = proxy.supervisor.send
    proxy.supervisor.send = lambda message: messages.append(message) or send(message)
    now_s = [0.0]  # the batch's clock, stopped: a slow machine's polls are not "later"
    monkeypatch.setattr(notices_module, "time", types.SimpleNamespace(monotonic=lambda: now_s[0]))
    for n in range(5):
        proxy.notify(name, b"n%d" % n)
        proxy.poll_notifications()  # as the executor polls after each read's notices: too soon to send
    assert [m for m in messages if m["op"] == "notify"] == []  # the control: nothing left before the wait
    now_s[0] += NOTICE_BATCH_S
    assert heard(holder, 10, proxy, count=5) == [(sender, b"n%d" % n) for n in range(5)]
    (batch,) = [m for m in messages if m["op"] == "notify"]
    assert len(batch["notices"]) == 5


def test_the_last_removal_sends_the_batch_before_it_unloads(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    proxy.connect_to(name)
    proxy.notify(name, b"before-unload")
    proxy.remove_remote(name)  # unloaded in the worker: the notice queued for it went first
    assert heard(holder, 10, proxy) == [(agent_name_of(proxy.metadata()), b"before-unload")]


def test_a_refused_notice_in_a_batch_skips_only_itself(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    proxy.connect_to(name)
    proxy.notify("kvx-test-nobody", b"lost")  # an agent the worker never loaded
    proxy.notify(name, b"kept")
    time.sleep(NOTICE_BATCH_S)
    assert heard(holder, 10, proxy) == [(agent_name_of(proxy.metadata()), b"kept")]


def test_after_a_replacement_notices_go_from_the_agent_each_holder_was_introduced_to(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())  # the handshake before: introduced to generation 1
    proxy.connect_to(name)
    first = proxy.supervisor.current
    proxy.supervisor.replace("test: trust ended")
    second = proxy.supervisor.wait_up(2, 30)
    old_agent, new_agent = agent_name_of(first.notices_metadata), agent_name_of(second.notices_metadata)
    proxy.notify(name, b"during-grace")
    time.sleep(NOTICE_BATCH_S)
    # The holder knows generation 1's agent only: from there (the control: generation 2's would be dropped).
    assert heard(holder, 10, proxy) == [(old_agent, b"during-grace")]
    proxy.add_remote(holder.metadata())  # the reader's next handshake introduces generation 2
    proxy.notify(name, b"after-handshake")
    time.sleep(NOTICE_BATCH_S)
    assert heard(holder, 10, proxy) == [(new_agent, b"after-handshake")]


def test_batches_are_cut_to_fit_the_channel():
    from kvxferd.service.workers.notices import _within_message
    from kvxferd.wire import workerchannel as channel

    notices = [["h" * channel.MAX_NAME_CHARS, "00" * channel.MAX_NOTICE_BYTES]] * channel.MAX_NOTICES
    parts = list(_within_message(notices))
    assert len(parts) > 1 and [n for part in parts for n in part] == notices  # the control: one would not fit
    assert all(len(json.dumps({"op": "notify", "notices": part})) <= channel.MAX_MESSAGE_BYTES for part in parts)
    assert len(json.dumps({"op": "notify", "notices": notices})) > channel.MAX_MESSAGE_BYTES
