"""The executor's notice agent in the worker (WorkerNotices): a holder hears the notices from the worker's
notice agent; references are counted here (the last removal unloads, and a notice then reaches nobody);
a new generation loads every holder still referenced again and its notices go on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvxferd.service.workers.notices import WorkerNotices
from kvxferd.service.workers.generation import Region
from kvxferd.service.workers.supervisor import WorkerSupervisor
from kvxferd.xfer.nixl.agent import NixlAgent, agent_name_of


@pytest.fixture
def notices():
    fd = os.memfd_create("kvx-test-cache")
    os.ftruncate(fd, 1 << 16)
    supervisor = WorkerSupervisor("kvx-test-nw", [Region(fd, 1 << 16)], on_up=lambda up: proxy.reload(up))
    proxy = WorkerNotices(supervisor)
    supervisor.start()
    holder = NixlAgent("kvx-test-holder")
    yield proxy, holder
    holder.close()
    supervisor.stop()
    os.close(fd)


def heard(holder: NixlAgent, wait_s: float) -> list[tuple[str, bytes]]:
    """What the holder heard within ``wait_s`` (it polls, as a holder does)."""
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        got += holder.new_messages()
        if got:
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
    assert heard(holder, 10) == [(sender, b"n1")]
    proxy.remove_remote(name)  # one reference left: still loaded
    proxy.notify(name, b"n2")
    assert heard(holder, 10) == [(sender, b"n2")]
    proxy.remove_remote(name)  # the last: unloaded in the worker
    proxy.notify(name, b"n3")
    assert heard(holder, 1.0) == []


def test_a_new_generation_loads_every_referenced_holder_again(notices):
    proxy, holder = notices
    name = proxy.add_remote(holder.metadata())
    first = proxy.supervisor.current
    os.kill(first.pid, signal.SIGKILL)
    second = proxy.supervisor.wait_up(2, 30)
    proxy.notify(name, b"after")
    assert heard(holder, 10) == [(agent_name_of(second.notices_metadata), b"after")]
    assert agent_name_of(second.notices_metadata) != agent_name_of(first.notices_metadata)
