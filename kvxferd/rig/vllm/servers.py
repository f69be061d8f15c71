"""The processes ``bench_vllm.py`` runs: vLLM API servers, kvxferd daemons, proxies, grouped as setups.

A setup is what one column of the benchmark talks to: a single plain vLLM
server, or a prefill/decode pair with its connector (kvxferd: a daemon per
server; NIXL: vLLM's own ``NixlConnector``, in-process) and a proxy in front.
Every server runs in its own session, so stopping it (or pausing it with
SIGSTOP) reaches its engine-core and worker processes too.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from kvxferd.client import DaemonProcess

BLOCK_SIZE = 32
# vLLM's log prefix, e.g. "(Worker pid=1) ERROR 11-26 00:36:40 [base_worker.py:687] "
LOG_PREFIX = re.compile(r"^\([^)]*\) +[A-Z]+ +[\d-]+ [\d:]+ \[[^\]]*\] ?")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|NotImplementedError)\b: ")


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (as servers do, ignoring connections in TIME_WAIT)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


def cpu_seconds(processes) -> float:
    """User + system CPU seconds of psutil ``processes`` so far."""
    import psutil

    total = 0.0
    for member in processes:
        try:
            times = member.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


class Process:
    """A child process in its own session (its process group: the process and everything it starts)."""

    def __init__(self, name: str, args: list[str], log: pathlib.Path, env: dict, port: int | None = None) -> None:
        self.name, self.args, self.log, self.port = name, args, log, port
        self.paused = False
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.failure()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer /health on port {self.port}: {self.failure()}")

    def failure(self) -> str:
        """Why the process stopped or never came up: the log's first exception, where it was raised, the log."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        where = None
        for line in lines:
            prefix = LOG_PREFIX.match(line)
            if prefix and " ERROR " not in prefix.group(0):
                continue  # vLLM logs harmless tracebacks as warnings (its chat-template warm-up, without a tokenizer)
            text = line[prefix.end():].strip() if prefix else line.strip()
            if text.startswith("File \""):
                where = text
            elif EXCEPTION_LINE.match(text):
                return f"{text}" + (f" (raised at {where})" if where else "") + f" (log: {self.log})"
        return f"{LOG_PREFIX.sub('', lines[-1]).strip() if lines else 'no output'} (log: {self.log})"

    def members(self) -> list:
        """psutil processes of this group (the server and its engine-core and worker processes)."""
        import psutil  # a vLLM dependency

        try:
            leader = psutil.Process(self.popen.pid)
            return [leader, *leader.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.members())

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def pause(self) -> None:
        if not self.paused and self.popen.poll() is None:
            self._signal_group(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal_group(signal.SIGCONT)
            self.paused = False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the group, wait for the leader, then SIGKILL whatever of the group is left."""
        self.resume()
        self._signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)  # children of a leader that exited cleanly are on their way out
        self._signal_group(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


def vllm_server(name: str, model: str, port: int, work: pathlib.Path, env: dict,
                transfer: dict | None = None, num_blocks: int | None = None) -> Process:
    """A ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 (real weights, token ids in and out, no prefix cache);
    ``num_blocks``: its KV cache pool (default: vLLM's size for the CPU's KV cache space)."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
            "--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--seed", "0",
            "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
    if num_blocks:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return Process(name, args, work / f"{name}.log", env, port)


def proxy(name: str, prefill_port: int, decode_port: int, port: int, work: pathlib.Path, env: dict,
          mode: str = "pull", push_layers: str = "auto") -> Process:
    return Process(name, [sys.executable, "-m", "kvxferd.integrations.vllm.proxy", "--prefill",
                          f"http://127.0.0.1:{prefill_port}", "--decode", f"http://127.0.0.1:{decode_port}",
                          "--host", "127.0.0.1", "--port", str(port), "--mode", mode, "--push-layers", push_layers],
                   work / f"{name}.log", env, port)


def nixl_push_proxy(name: str, prefill_port: int, decode_port: int, port: int, work: pathlib.Path, env: dict,
                    engine_id: str, side_port: int) -> Process:
    """The proxy for vLLM's NixlPushConnector (kvxferd/rig/vllm/nixlpush.py): both legs at once."""
    return Process(name, [sys.executable, "-m", "kvxferd.rig.vllm.nixlpush", "--prefill",
                          f"http://127.0.0.1:{prefill_port}", "--decode", f"http://127.0.0.1:{decode_port}",
                          "--engine-id", engine_id, "--side-port", str(side_port), "--port", str(port)],
                   work / f"{name}.log", env, port)


def kvxferd_transfer(engine_id: str, engine_socket: str, push_layer_min_tokens: int | None = None) -> dict:
    """The kvxferd connector in push mode: it serves pulls as well, so one pair of servers is both columns
    (``push_layer_min_tokens``: pushes of prompts that long written layer by layer; None: the connector's
    default)."""
    extra = {"engine_socket": engine_socket, "mode": "push"}
    if push_layer_min_tokens is not None:
        extra["push_layer_min_tokens"] = push_layer_min_tokens
    return {"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.integrations.vllm",
            "kv_role": "kv_both", "engine_id": engine_id, "kv_connector_extra_config": extra}


def nixl_transfer(engine_id: str, role: str, num_threads: int | None = None, connector: str = "NixlConnector") -> dict:
    """vLLM's NixlConnector on the CPU platform: the KV cache is host memory, so the buffer device is "cpu"
    (the only one ``_NIXL_SUPPORTED_DEVICE["cpu"]`` allows); producer for prefill, consumer for decode.
    ``num_threads``: the NIXL UCX backend's threads (vLLM's ``kv_connector_extra_config``; vLLM: 4).
    ``connector``: ``NixlPushConnector`` for vLLM's push mode."""
    config = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu", "engine_id": engine_id}
    if num_threads is not None:
        config["kv_connector_extra_config"] = {"num_threads": num_threads}
    return config


def nixl_log_notes(log: pathlib.Path) -> dict[str, int]:
    """What a NixlConnector prefill server logged about holds its decode did not release in time."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    return {"expired_before_read": text.count("Releasing expired KV blocks"),
            "read_after_expiry": text.count("Potentially invalid KV blocks")}


NIXL_PATCHES = '''"""Written by kvxferd/rig/vllm/bench.py: NixlConnector changes it was asked for ($KVX_BENCH_NIXL_PATCHES).

no-progress-thread: nixl's Python API starts each agent's UCX progress thread polling without a pause
  (a core per agent) unless nixl_agent_config(enable_prog_thread=False), which vLLM cannot ask for.
no-pin: on the CPU platform vLLM's NIXL worker pins the thread that builds it (the model runner's
  main thread, the OpenMP master) to the last core of each NUMA node, meaning to keep start_load_kv
  off the forward pass's cores; discover_numa_topology() returning [] skips that.
"""
import importlib.abc
import importlib.util
import os
import sys

PATCHES = set(os.environ.get("KVX_BENCH_NIXL_PATCHES", "").split(","))


def _no_progress_thread(module):
    init = module.nixl_agent_config.__init__

    def without_progress_thread(config, *args, **kwargs):
        init(config, *args, **kwargs)
        config.enable_pthread = False

    module.nixl_agent_config.__init__ = without_progress_thread


def _no_pin(module):
    module.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])


WANTED = {}
if "no-progress-thread" in PATCHES:
    WANTED["nixl_cu13._api"] = WANTED["nixl._api"] = _no_progress_thread
if "no-pin" in PATCHES:
    WANTED["vllm.platforms.cpu"] = _no_pin


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WANTED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            WANTED[name](module)

        spec.loader.exec_module = exec_module
        return spec


if WANTED:
    sys.meta_path.insert(0, _Finder())
'''


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (any labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Setup:
    """One column: where requests go (``url``), and for P/D the legs (``prefill``/``decode`` ports)."""

    name: str
    port: int  # the single server, or the proxy
    processes: list[Process] = field(default_factory=list)
    prefill: int | None = None
    decode: int | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    pausable: bool = False  # paused (SIGSTOP) while other setups are measured
    error: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    @property
    def servers(self) -> list[Process]:
        return [p for p in self.processes if p.name.endswith(("prefill", "decode", "single"))]

    def resume(self) -> bool:
        """Whether anything was paused."""
        paused = any(process.paused for process in self.processes)
        for process in self.processes:
            process.resume()
        return paused

    def pause(self) -> None:
        if self.pausable and self.error is None:
            for process in self.processes:
                process.pause()

    def read_metrics(self) -> dict[str, float]:
        """The decode side's transfer counters: bytes, transfers, seconds in reads (and handshakes, kvxferd).
        kvxferd's push column: the bytes its prefill daemon wrote, the decode daemon's expectations."""
        if self.daemons and self.name.startswith("kvxferd-push"):  # (both push columns' traffic together)
            written = scrape(self.daemons[0].addresses["metrics"])
            expected = scrape(self.daemons[-1].addresses["metrics"])
            return {"bytes": metric_sum(written, "kvxferd_push_bytes_total"),
                    "reads": metric_sum(expected, "kvxferd_push_duration_seconds_count"),
                    "read_s": metric_sum(expected, "kvxferd_push_duration_seconds_sum")}
        if self.daemons:
            text = scrape(self.daemons[-1].addresses["metrics"])
            engine = scrape(f"http://127.0.0.1:{self.decode}/metrics")  # the connector's own view, if it exports it
            return {"bytes": metric_sum(text, "kvxferd_read_bytes_total"),
                    "reads": metric_sum(text, "kvxferd_read_duration_seconds_count"),
                    "read_s": metric_sum(text, "kvxferd_read_duration_seconds_sum"),
                    "handshakes": metric_sum(text, "kvxferd_handshake_duration_seconds_count"),
                    "handshake_s": metric_sum(text, "kvxferd_handshake_duration_seconds_sum"),
                    "waits": metric_sum(engine, "vllm:kvxferd_wait_time_seconds_count"),
                    "wait_s": metric_sum(engine, "vllm:kvxferd_wait_time_seconds_sum")}
        if self.decode is not None:
            text = scrape(f"http://127.0.0.1:{self.decode}/metrics")
            return {"bytes": metric_sum(text, "vllm:nixl_bytes_transferred_sum"),
                    "reads": metric_sum(text, "vllm:nixl_xfer_time_seconds_count"),
                    "read_s": metric_sum(text, "vllm:nixl_xfer_time_seconds_sum")}
        return {}

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
        for daemon in self.daemons:
            daemon.terminate()


def start_setups(setups: dict[str, Setup], names: list[str], model: str, base: int, work: pathlib.Path,
                 single_on_prefill: bool, pause_nixl: bool, nixl_patches: tuple[str, ...] = (),
                 reserved_cpus: str = "1", nixl_threads: int | None = None,
                 worker_cores: tuple[str, str] | None = None, push_layer_min_tokens: int | None = None,
                 num_blocks: int | None = None) -> None:
    """Start every setup's processes at once (start-up runs in parallel), then wait for each.

    Ports (all on 127.0.0.1): kvxferd proxy base-100, prefill base, decode base+100 (as before);
    single base+200; NIXL proxy base+300, prefill base+400 (side channel base+450), decode base+500
    (side channel base+550); kvxferd daemons' peer/notify/metrics base+600.. (prefill), base+610.. (decode).
    ``setups`` is filled as processes start (the caller stops them, also when this raises). A NIXL
    setup that does not come up gets ``error`` (its processes are stopped); the others go on.
    """
    server = functools.partial(vllm_server, num_blocks=num_blocks)  # every server's pool alike
    wanted = {"kvxferd": [base - 100, base, base + 100, *range(base + 600, base + 603), *range(base + 610, base + 613)],
              "kvxferd-push": [base - 90], "kvxferd-push-layers": [base - 80],
              "single": [] if single_on_prefill else [base + 200],
              "nixl": [base + 300, base + 400, base + 450, base + 500, base + 550],
              "nixl-push": [base + 700, base + 800, base + 850, base + 900, base + 950]}
    taken = [port for name in names for port in wanted[name] if not port_is_free(port)]
    if taken:
        raise SystemExit(f"ports in use on 127.0.0.1: {taken}; pick another --base-port")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if reserved_cpus != "auto":
        # vLLM reserves 1 core of the OpenMP binding on its own, 2 with any kv_transfer_config (and
        # when that leaves none, binds every core): a plain and a P/D server would compute on
        # different cores. One number for all keeps the forward passes alike.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved_cpus
    kvx = setups["kvxferd"] = Setup("kvxferd", base - 100, prefill=base, decode=base + 100)
    for offset, daemon_id in ((600, "bp0"), (610, "bd0")):
        ports = ("--peer-port", str(base + offset), "--notify-port", str(base + offset + 1),
                 "--metrics-port", str(base + offset + 2))
        kvx.daemons.append(DaemonProcess(daemon_id, socket_dir=str(work), extra_args=ports, wait=False))
    for daemon in kvx.daemons:
        daemon.wait_ready()
    roles = (("prefill", base, kvx.daemons[0]), ("decode", base + 100, kvx.daemons[1]))
    for n, (role, port, daemon) in enumerate(roles):
        # worker_cores: each P/D server's model on cores of its own (vLLM's OpenMP binding); else vLLM's
        # choice, which on a 2-core host puts every server's worker on core 0
        bind = {"VLLM_CPU_OMP_THREADS_BIND": worker_cores[n]} if worker_cores else {}
        kvx.processes.append(server(f"kvxferd-{role}", model, port, work, {**env, **bind},
                                    kvxferd_transfer(f"kvx-{role}", daemon.socket, push_layer_min_tokens)))
    kvx.processes.append(proxy("kvxferd-proxy", base, base + 100, base - 100, work, env))
    if "kvxferd-push" in names:  # the same servers and daemons, a proxy in push mode (issue #57)
        push = setups["kvxferd-push"] = Setup("kvxferd-push", base - 90, prefill=base, decode=base + 100,
                                              daemons=kvx.daemons)
        # with a layer-by-layer column beside it, this one is the whole write after the forward pass
        layers = "off" if "kvxferd-push-layers" in names else "auto"
        push.processes.append(proxy("kvxferd-push-proxy", base, base + 100, base - 90, work, env, mode="push",
                                    push_layers=layers))
    if "kvxferd-push-layers" in names:  # the same again, every push layer by layer (the proxy asks for it)
        layered = setups["kvxferd-push-layers"] = Setup("kvxferd-push-layers", base - 80, prefill=base,
                                                        decode=base + 100, daemons=kvx.daemons)
        layered.processes.append(proxy("kvxferd-push-layers-proxy", base, base + 100, base - 80, work, env,
                                       mode="push", push_layers="on"))
    if "single" in names:
        if single_on_prefill:
            setups["single"] = Setup("single", base)
        else:
            setups["single"] = Setup("single", base + 200, [server("single", model, base + 200, work, env)])
    if "nixl" in names:
        nixl = setups["nixl"] = Setup("nixl", base + 300, prefill=base + 400, decode=base + 500, pausable=pause_nixl)
        patch = {}
        if nixl_patches:
            (work / "nixl-patch").mkdir(exist_ok=True)
            (work / "nixl-patch" / "sitecustomize.py").write_text(NIXL_PATCHES)
            patch = {"KVX_BENCH_NIXL_PATCHES": ",".join(nixl_patches),
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "nixl-patch"),
                                                                  os.environ.get("PYTHONPATH")]))}
        for role, port, kv_role in (("prefill", base + 400, "kv_producer"), ("decode", base + 500, "kv_consumer")):
            nixl_env = {**env, **patch, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 50), "UCX_NET_DEVICES": "lo"}
            nixl.processes.append(server(f"nixl-{role}", model, port, work, nixl_env,
                                         nixl_transfer(f"nixl-{role}", kv_role, nixl_threads)))
        nixl.processes.append(proxy("nixl-proxy", base + 400, base + 500, base + 300, work, env))
    if "nixl-push" in names:  # vLLM's NixlPushConnector (issue #57's comparison)
        nixl = setups["nixl-push"] = Setup("nixl-push", base + 700, prefill=base + 800, decode=base + 900,
                                           pausable=pause_nixl)
        for role, port, kv_role in (("prefill", base + 800, "kv_producer"), ("decode", base + 900, "kv_consumer")):
            nixl_env = {**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 50), "UCX_NET_DEVICES": "lo"}
            nixl.processes.append(server(f"nixl-push-{role}", model, port, work, nixl_env,
                                         nixl_transfer(f"nixl-push-{role}", kv_role, nixl_threads,
                                                       "NixlPushConnector")))
        nixl.processes.append(nixl_push_proxy("nixl-push-proxy", base + 800, base + 900, base + 700, work, env,
                                              "nixl-push-prefill", base + 850))
    deadline = time.monotonic() + 600
    for setup in setups.values():
        for process in setup.processes:
            try:
                if process.name.endswith("proxy"):
                    wait_port(process.port)
                else:
                    process.wait_healthy(deadline)
            except RuntimeError as err:
                if not setup.name.startswith("nixl"):
                    raise
                setup.error = str(err)
                break
        if setup.error:
            setup.stop()
