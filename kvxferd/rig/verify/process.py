"""A child process that runs one engine object and answers the driver's commands over a pipe.

The demo's, the soak's and ``kvxferd bench gpu``'s engines each live in a
process of their own, as beside a real daemon. The driver sends
``(command, args)``; the child calls that method of its engine and answers
``("ok", value)`` or ``("error", message)``: a failure in an engine is
reported, never a hang, and an engine that dies is :class:`EngineFailed`.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback

from kvxferd.xfer.osutil.fdtable import reserve_fd_table


def engine_main(kind: str, factory, args: tuple, kwargs: dict, conn, netns: str | None = None,
                environ: dict | None = None) -> None:
    """Body of an engine process: build the engine (``factory``), then serve commands until ``stop``;
    first, in ``netns`` (a host of the namespace rig) with ``environ`` set, if given."""
    try:
        if netns is not None:  # while this process has one thread
            from kvxferd.rig.verify.hosts.nsenter import enter_netns
            enter_netns(netns)
        os.environ.update(environ or {})
        reserve_fd_table()  # before the engine starts threads: its table then never grows under load (fdtable.py)
        engine = factory(*args, **kwargs)
    except Exception as err:
        conn.send(("error", f"{kind} engine did not start: {type(err).__name__}: {err}"))
        return
    conn.send(("ok", None))
    try:
        while True:
            command, command_args = conn.recv()
            if command == "stop":
                break
            try:
                conn.send(("ok", getattr(engine, command)(*command_args)))
            except Exception as err:
                conn.send(("error", f"{kind} engine: {command}: {type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"))
    finally:
        engine.close()
        conn.send(("ok", None))


class EngineFailed(RuntimeError):
    """An engine process reported an error or stopped answering."""


class EngineProcess:
    """Driver-side handle of one engine process."""

    def __init__(self, kind: str, *args, factory, start_timeout_s: float = 120.0, wait: bool = True,
                 netns: str | None = None, environ: dict | None = None, **kwargs) -> None:
        """``factory(*args, **kwargs)`` builds the engine in the child: an importable class (spawned, not forked);
        ``netns``: the child runs in that network namespace (a host of the rig), with ``environ`` set."""
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC threads
        self.kind = kind
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(kind, factory, args, kwargs, child, netns, environ),
                                       daemon=True, name=f"kvxferd-engine-{kind}")
        self.process.start()
        child.close()
        self.start_timeout_s = start_timeout_s
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Block until the engine was built (or raise what went wrong)."""
        self._answer(self.start_timeout_s, "start")

    def _answer(self, timeout_s: float, what: str):
        if not self._conn.poll(timeout_s):
            raise EngineFailed(f"{self.kind} engine: no answer to {what} after {timeout_s:g} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):  # OSError: it died with a command unread (the pipe was reset)
            self.process.join(1.0)
            raise EngineFailed(f"{self.kind} engine exited (code {self.process.exitcode}) during {what}") from None
        if status != "ok":
            raise EngineFailed(value)
        return value

    def call(self, command: str, *args, timeout_s: float = 120.0):
        """Run ``command`` in the engine process; its return value, or :class:`EngineFailed`."""
        self.send(command, *args)
        return self._answer(timeout_s, command)

    def send(self, command: str, *args) -> None:
        """Start ``command`` without waiting; :meth:`answer` collects its result."""
        try:
            self._conn.send((command, args))
        except OSError as err:
            raise EngineFailed(f"{self.kind} engine is gone ({err})") from None

    def answer(self, command: str, timeout_s: float = 120.0):
        """The result of the command started last with :meth:`send`."""
        return self._answer(timeout_s, command)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to deregister and free its memory, then make sure it is gone."""
        if self.process.is_alive():
            try:
                self._conn.send(("stop", ()))
                self._answer(timeout_s, "stop")
            except (EngineFailed, OSError):
                pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
