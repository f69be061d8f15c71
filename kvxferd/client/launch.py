"""Start ``kvxferd serve`` as a child process and learn its addresses."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

READY = re.compile(r"^kvxferd ready: (.*)$")
NUM_FIXED_PORTS = 12000  # how far below the ephemeral range listeners' ports are drawn
PORT_FLAGS = frozenset({"--peer-port", "--notify-port", "--metrics-port"})
PORT_RACE_ATTEMPTS = 5  # starts of a daemon whose drawn port was taken before it bound it


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out for port 0 (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` ports free now, drawn below the ephemeral range.

    A daemon restarted in place must get its old ports back, but a port the
    kernel picked for port 0 can be taken meanwhile by anyone who asks for
    port 0, and every NIXL agent does: UCX's TCP transport listens on two
    ephemeral ports per agent. Ports below that range are taken only by
    whoever names them.
    """
    top = ephemeral_port_floor()
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(max(1024, top - NUM_FIXED_PORTS), top)
        if port not in ports and port_is_free(port, host):
            ports.append(port)
    return ports


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` on ``host`` can be bound now."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class DaemonProcess:
    """A daemon child process; ``addresses`` has engine, peer, notify, metrics."""

    def __init__(self, daemon_id: str, *, socket_dir: str | None = None, extra_args: tuple[str, ...] = (),
                 ready_timeout_s: float = 60.0, env: dict | None = None, wait: bool = True,
                 default_socket: bool = False, prefix: tuple[str, ...] = (), module: str = "kvxferd") -> None:
        """``default_socket``: let the daemon pick its engine socket (its private runtime directory);
        ``prefix``: the command runs as ``prefix + [python, -m, module, serve, ...]`` (``ip netns exec NS``);
        ``module``: what ``python -m`` runs (a test rig's wrapper of kvxferd's command line)."""
        self.daemon_id, self.prefix, self.module = daemon_id, tuple(prefix), module
        self.socket = os.path.join(socket_dir or tempfile.gettempdir(), f"{daemon_id}.sock")
        self._socket_args = () if default_socket else ("--engine-socket", self.socket)
        self._extra_args, self._env = tuple(extra_args), env
        # Ports drawn here are free when drawn, not when the daemon binds them a second later: another
        # process may take one meanwhile. A daemon that lost that race is started again on new ports;
        # one whose ports were given (a restart in place) is not.
        self._own_ports = not any(arg in PORT_FLAGS for arg in self._extra_args)
        self.log_path = os.path.join(socket_dir or tempfile.gettempdir(), f"{daemon_id}.log")
        self._log = open(self.log_path, "ab")
        self.ready_timeout_s = ready_timeout_s
        self.addresses: dict[str, str] = {}
        self._launch()
        if wait:
            self.wait_ready()

    def _launch(self) -> None:
        peer, notify, metrics = free_ports(3)  # flags in extra_args come later and win (a restart in place)
        self.args = [*self.prefix, sys.executable, "-m", self.module, "serve", "--daemon-id", self.daemon_id, *self._socket_args,
                     "--peer-port", str(peer), "--notify-port", str(notify), "--metrics-port", str(metrics),
                     *self._extra_args]
        self._log_start = os.path.getsize(self.log_path)  # this start's lines begin here
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env={**os.environ, **(self._env or {})})

    @classmethod
    def start_many(cls, daemon_ids, *, args_of=None, **kwargs) -> list["DaemonProcess"]:
        """Start several daemons at once, then wait for each (start-up runs in parallel). ``args_of``: more
        flags for one daemon, by its id (after ``extra_args``)."""
        extra = tuple(kwargs.pop("extra_args", ()))
        return cls.wait_all([cls(daemon_id, wait=False, extra_args=extra + (tuple(args_of(daemon_id)) if args_of
                                                                              else ()), **kwargs)
                             for daemon_id in daemon_ids])

    @staticmethod
    def wait_all(daemons: list["DaemonProcess"]) -> list["DaemonProcess"]:
        """Wait for each of ``daemons`` (started with ``wait=False``); if one fails, kill them all and raise."""
        try:
            for daemon in daemons:
                daemon.wait_ready()
        except BaseException:
            for daemon in daemons:
                daemon.kill()
            raise
        return daemons

    def wait_ready(self) -> dict[str, str]:
        """Block until the ready line; raises with the log tail if the daemon died."""
        for attempt in range(PORT_RACE_ATTEMPTS):
            try:
                self.addresses = self._wait_ready(self.ready_timeout_s)
                break
            except RuntimeError:
                if not (self._own_ports and attempt + 1 < PORT_RACE_ATTEMPTS and self._lost_a_port()):
                    raise
                self.process.stdout.close()
                self._launch()
        self.socket = self.addresses["engine"].removeprefix("unix:")
        return self.addresses

    def _wait_ready(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            if match := READY.match(line.strip()):
                return dict(part.split("=", 1) for part in match.group(1).split())
        self.kill()
        raise RuntimeError(f"daemon {self.daemon_id} did not start (exit {self.process.poll()}); log: {self.tail()}")

    def _lost_a_port(self) -> bool:
        """Whether the last start failed because one of its ports was taken meanwhile."""
        return "Address already in use" in self.log_text()

    def log_text(self, since_byte: int = 0) -> str:
        """What this start of the daemon logged so far (a restart appends to the same file), from
        ``since_byte`` of it on (:meth:`log_bytes` taken earlier: only what came since)."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start + since_byte)
            return log.read().decode(errors="replace")

    def log_bytes(self) -> int:
        """How many bytes this start of the daemon logged so far."""
        return os.path.getsize(self.log_path) - self._log_start

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of this daemon's Prometheus metrics (``labels`` as exported, e.g. ``kind="uid"``); 0 if absent."""
        for line in self.metrics_text().splitlines():
            if line.startswith(f"{name} " if not labels else f"{name}{{{labels}}} ") or line.startswith(name + "{} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def labelled(self, name: str, *labels: str) -> dict[str, float]:
        """A labelled metric's non-zero series: ``{"<label value>[: <label value>...]": value}``."""
        found = {}
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") and not line.endswith(" 0.0"):
                pairs = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
                key = ": ".join(pairs[label].strip('"') for label in labels)
                found[key] = float(line.rsplit(" ", 1)[1])
        return found

    def transport_paths(self) -> dict[str, int]:
        """``{"<memory>: <path>": UCX endpoint configurations}`` this daemon's READs took (kvxferd_transport_paths)."""
        return {key: int(value) for key, value in self.labelled("kvxferd_transport_paths", "memory", "path").items()}

    def metrics_text(self) -> str:
        """This daemon's metrics page, as Prometheus scrapes it."""
        return urllib.request.urlopen(self.addresses["metrics"], timeout=5).read().decode()

    @property
    def engine_target(self) -> str:
        return self.addresses["engine"]

    @property
    def peer_address(self) -> str:
        return self.addresses["peer"]

    def port_args(self, listeners: tuple[str, ...] = ("peer", "notify", "metrics")) -> tuple[str, ...]:
        """``--<listener>-port N`` flags that start a new daemon on this one's ports (a restart in place)."""
        flags: list[str] = []
        for listener in listeners:  # addresses look like 127.0.0.1:N, tcp://127.0.0.1:N, http://127.0.0.1:N/metrics
            port = self.addresses[listener].rstrip("/").rsplit(":", 1)[1].split("/")[0]
            flags += [f"--{listener}-port", port]
        return tuple(flags)

    def tail(self, num_bytes: int = 3000) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - num_bytes))
            return log.read().decode(errors="replace")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
