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


def test_engine_death_process_fd_index_checked_by_a_real_daemon(workdir):
    """Over the sockets: an index past the fds sent, an fd that is no pidfd, and a pidfd named as a region's
    memory are each refused INVALID_ARGUMENT naming the field; this process's own pidfd is taken."""
    import secrets

    import grpc

    from kvxferd.client import DaemonProcess, EngineClient
    from kvxferd.client.fdsend import own_process_fd, send_fds
    from kvxferd.wire.names import fd_socket_path
    from tests.service.engines.test_fd_socket_raw import MemfdEngine

    daemon = DaemonProcess("lifeline", socket_dir=workdir)
    memfd, clients = MemfdEngine(), []
    try:
        def register(fds, index, region_fd_index=0):
            token = secrets.token_hex(16)
            send_fds(fd_socket_path(daemon.socket), token, fds)
            message = type(memfd.message)()
            message.CopyFrom(memfd.message)
            for region in (r for group in message.groups for r in group.regions):
                region.handle.shm_fd_index = region_fd_index
            client = EngineClient(daemon.engine_target)
            clients.append(client)
            return client.register(message, fd_token=token, process_fd_index=index, heartbeat_s=0)

        for fds, index, region, field in [([memfd.fd], 3, 0, "process_fd_index"),
                                          ([memfd.fd, memfd.fd], 1, 0, "process_fd_index"),
                                          ([memfd.fd, own_process_fd()], 1, 1, "shm_fd_index")]:
            with pytest.raises(grpc.RpcError) as err:
                register(fds, index, region)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), \
                err.value.details()
        assert daemon.metric("kvxferd_engines_registered") == 0
        assert register([memfd.fd, own_process_fd()], 1).incarnation
        assert daemon.metric("kvxferd_engines_registered") == 1
    finally:
        for client in clients:
            client.close()
        daemon.terminate()
        memfd.close()
