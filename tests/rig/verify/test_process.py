"""The driver's handle of an engine process: an engine that dies is EngineFailed, whatever the pipe says."""

import resource
import time

import pytest

from kvxferd.rig.verify.process import EngineFailed, EngineProcess
from kvxferd.xfer.osutil.fdtable import RESERVED_FDS, fd_table_size


class Napper:
    """The smallest engine: one command that takes a while."""

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def close(self) -> None:
        pass


def test_an_engine_killed_with_a_command_unread_is_engine_failed():
    # The soak kills an engine while its read command may still sit unread in the pipe; the
    # driver's next receive is then ECONNRESET, not EOF (a CI run stopped on it).
    engine = EngineProcess("napper", factory=Napper, start_timeout_s=60)
    try:
        engine.send("nap", 30.0)
        engine.send("nap", 0.0)  # unread while the first naps
        time.sleep(0.3)
        engine.process.kill()
        engine.process.join()
        with pytest.raises(EngineFailed, match="exited"):
            engine.answer("nap", 5)
    finally:
        engine.close(timeout_s=1)


def test_an_engine_killed_between_commands_is_engine_failed():
    engine = EngineProcess("napper", factory=Napper, start_timeout_s=60)
    try:
        assert engine.call("nap", 0.0) == 0.0
        engine.process.kill()
        engine.process.join()
        with pytest.raises(EngineFailed, match="napper engine (is gone|exited)"):
            engine.call("nap", 0.0, timeout_s=5)
    finally:
        engine.close(timeout_s=1)


class FdTable:
    """An engine that reports its process's fd table."""

    def size(self) -> int:
        return fd_table_size()

    def close(self) -> None:
        pass


def test_an_engine_process_grows_its_fd_table_before_its_engine_starts():
    # As a daemon does (xfer/osutil/fdtable.py): grown while the child has one thread, it never grows under load.
    engine = EngineProcess("fds", factory=FdTable, start_timeout_s=60)
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert engine.call("size") >= min(RESERVED_FDS, soft)
    finally:
        engine.close(timeout_s=5)
