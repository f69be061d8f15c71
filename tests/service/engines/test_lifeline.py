"""An engine's pidfd: only a pidfd of a live process is taken; the watch fires once, when that process exits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.engines.lifeline import ProcessWatch, process_of


def test_engine_death_pidfd_checked():
    own = os.pidfd_open(os.getpid())
    memfd = os.memfd_create("not-a-pidfd")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    exited = os.pidfd_open(child.pid)
    child.wait()
    try:
        assert process_of(own, "f") == os.getpid()
        with pytest.raises(InvalidArgumentError, match="not a pidfd"):
            process_of(memfd, "f")
        with pytest.raises(InvalidArgumentError, match="has exited"):
            process_of(exited, "f")
        assert process_of(exited, "f", exited_ok=True) == -1
    finally:
        for fd in (own, memfd, exited):
            os.close(fd)


def test_engine_death_watch_fires_once_at_exit():
    async def scenario():
        loop = asyncio.get_running_loop()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        fired = asyncio.Event()
        calls = []
        watch = ProcessWatch(os.pidfd_open(child.pid), loop, lambda: (calls.append(1), fired.set()))
        await asyncio.sleep(0.2)
        assert not calls and watch.pid == child.pid  # alive: nothing
        child.kill()
        await asyncio.wait_for(fired.wait(), 5)
        child.wait()
        await asyncio.sleep(0.1)
        watch.close()  # idempotent after firing
        return calls, watch.fd

    calls, fd = asyncio.run(scenario())
    assert calls == [1] and fd == -1
