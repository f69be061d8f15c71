"""A real Prometheus server and promtool for tests (Debian's ``prometheus`` package; scripts/system-deps.sh).

    promtool() -> str | None                      the promtool binary, None if not installed
    prometheus() -> str | None                    the prometheus binary, None if not installed
    run_promtool(*args, stdin="") -> CompletedProcess   e.g. run_promtool("check", "rules", path)
    lint_metrics(text) -> list[str]               promtool's metric lint, in Python (no binary needed)
    running_prometheus(targets, ...) -> Prometheus   a context manager: a server scraping ``targets``

    with running_prometheus(["127.0.0.1:9464"], labels={"namespace": "ns"}, rule_files=[path]) as prom:
        prom.wait_for("up == 1")                  # polls until the query returns a series
        prom.query('sum(rate(x_total[10s]))')     # the instant vector: [{"metric": {...}, "value": [t, "v"]}]
        prom.label_values("namespace", "up")      # what Grafana's label_values(up, namespace) lists
        prom.alerts()                             # the alerts of rule_files, pending or firing

The server listens on a free loopback port, scrapes every target every ``interval_s`` (1 s) and
evaluates rules as often; its storage is a temporary directory, removed on exit. Only the standard
library speaks to it (urllib), so the tests need nothing beyond the Debian package.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from kvxferd.client.launch import free_ports

START_TIMEOUT_S = 30.0
START_ATTEMPTS = 3  # a free port drawn here may be taken before the server binds it


def promtool() -> str | None:
    """The promtool binary (on PATH, else Debian's /usr/bin/promtool), or None."""
    return _binary("promtool")


def prometheus() -> str | None:
    """The prometheus server binary (on PATH, else Debian's /usr/bin/prometheus), or None."""
    return _binary("prometheus")


def _binary(name: str) -> str | None:
    path = shutil.which(name) or f"/usr/bin/{name}"
    return path if shutil.which(path) else None


def run_promtool(*args: str, stdin: str = "", timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``promtool *args`` (``check metrics`` reads the page from ``stdin``); stdout and stderr as text."""
    return subprocess.run([promtool() or "promtool", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout_s)


# promtool's lint (client_golang's promlint), for the text exposition format 0.0.4.
_UNIT_PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi", "mega",
                  "mebi", "giga", "gibi", "tera", "tebi", "peta", "pebi")
_BASE_UNITS = ("amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters", "metres", "seconds", "volts")
_TIME_UNITS = ("minutes", "hours", "days", "weeks")
_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_TYPES = ("counter", "gauge", "histogram", "summary")


def lint_metrics(text: str) -> list[str]:
    """Problems in a Prometheus text page (format 0.0.4), one line each; [] when clean.

    promtool's rules (no HELP, a counter without ``_total`` or another type with it, ``:`` in a name,
    camelCase, non-base or abbreviated units, the type in the name, a histogram's suffix on another
    type), and ours: no ``_created`` series (prometheus_client's creation times)."""
    helps, types, samples = {}, {}, set()
    for line in text.splitlines():
        if match := re.match(r"# (HELP|TYPE) (\S+) ?(.*)", line):
            (helps if match.group(1) == "HELP" else types)[match.group(2)] = match.group(3).strip()
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    problems = [f'{name} is a "_created" series' for name in sorted(samples | set(types))
                if name.endswith("_created")]
    for name, kind in sorted(types.items()):
        tokens = name.split("_")
        if not helps.get(name):
            problems.append(f"{name} no help text")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f'{name} counter metrics should have "_total" suffix')
        if kind != "counter" and name.endswith("_total"):
            problems.append(f'{name} non-counter metrics should not have "_total" suffix')
        if ":" in name:
            problems.append(f"{name} metric names should not contain ':'")
        if name != name.lower():
            problems.append(f"{name} metric names should be written in 'snake_case' not 'camelCase'")
        for token in tokens:
            if token in _TIME_UNITS or (token.startswith(_UNIT_PREFIXES) and token.endswith(_BASE_UNITS)):
                problems.append(f'{name} use base unit instead of "{token}"')
            if token in _ABBREVIATIONS:
                problems.append(f'{name} metric names should not contain abbreviated units "{token}"')
        if kind in tokens:
            problems.append(f'{name} metric name should not include type "{kind}"')
        if kind not in ("histogram", "summary") and name.endswith(("_bucket", "_count", "_sum")):
            problems.append(f"{name} {kind} metrics should not have a histogram's or summary's suffix")
    return problems


class Prometheus:
    """A running server's HTTP API (``url``: http://127.0.0.1:PORT); see :func:`running_prometheus`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _get(self, path: str, **params) -> object:
        """GET ``/api/v1/<path>``; its ``data``. Raises RuntimeError with Prometheus's error (a bad query)."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Evaluate PromQL ``expr`` now (or at unix time ``at``): the series of an instant vector,
        ``[{"metric": {label: value}, "value": [time, "value"]}]``; [] when none."""
        data = self._get("query", query=expr, **({} if at is None else {"time": at}))
        return data["result"] if data["resultType"] == "vector" else [data["result"]]

    def wait_for(self, expr: str, timeout_s: float = 20.0) -> list[dict]:
        """:meth:`query` ``expr`` until it returns a series; raises AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(expr)):
            assert time.monotonic() < deadline, f"no series for {expr} within {timeout_s} s; targets: {self.targets()}"
            time.sleep(0.2)
        return result

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        """The values of ``label`` on series matching selector ``match`` (all series if None), as Grafana's
        ``label_values(match, label)`` asks for them."""
        return self._get(f"label/{urllib.parse.quote(label)}/values", **({"match[]": match} if match else {}))

    def targets(self) -> list[dict]:
        """The active scrape targets with their health and last error."""
        return [{key: t.get(key) for key in ("scrapeUrl", "health", "lastError")}
                for t in self._get("targets")["activeTargets"]]

    def alerts(self) -> list[dict]:
        """The alerts of the rule files now pending or firing (``labels``, ``state``, ``value``...)."""
        return self._get("alerts")["alerts"]

    def rules(self) -> list[dict]:
        """The rule groups loaded from the rule files, each rule with its health and last error."""
        return self._get("rules")["groups"]


@contextlib.contextmanager
def running_prometheus(targets: list[str], *, labels: dict[str, str] | None = None, rule_files: tuple[str, ...] = (),
                       interval_s: float = 1.0, job: str = "kvxferd") -> Iterator[Prometheus]:
    """A Prometheus server scraping ``targets`` (``host:port``, path /metrics) every ``interval_s``, each
    series with the target labels ``labels`` (``namespace``, ``pod`` as Kubernetes discovery gives them),
    evaluating ``rule_files`` as often; stopped and its storage removed on exit."""
    binary = prometheus()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (scripts/system-deps.sh installs it)")
    workdir = tempfile.mkdtemp(prefix="kvx-prom")
    interval = f"{int(interval_s * 1000)}ms"
    config = {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
              "rule_files": [str(path) for path in rule_files],
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets),
                                                                        "labels": dict(labels or {})}]}]}
    with open(f"{workdir}/prometheus.yml", "w") as file:
        json.dump(config, file)  # YAML is a superset of JSON
    server = None
    try:
        for attempt in range(START_ATTEMPTS):
            server, url = _start(binary, workdir)
            if _ready(server, url):
                break
            server.kill()
            server.wait()
            log = _log_tail(workdir)
            if "address already in use" not in log or attempt + 1 == START_ATTEMPTS:
                raise RuntimeError(f"prometheus did not start; its log:\n{log}")
        yield Prometheus(url)
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _start(binary: str, workdir: str) -> tuple[subprocess.Popen, str]:
    [port] = free_ports(1)
    with open(f"{workdir}/prometheus.log", "ab") as log:
        server = subprocess.Popen([binary, f"--config.file={workdir}/prometheus.yml",
                                   f"--storage.tsdb.path={workdir}/data", f"--web.listen-address=127.0.0.1:{port}",
                                   "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    return server, f"http://127.0.0.1:{port}"


def _ready(server: subprocess.Popen, url: str) -> bool:
    """Wait until the server answers /-/ready; False if it exited or did not get there in time."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    return False


def _log_tail(workdir: str, num_bytes: int = 3000) -> str:
    with open(f"{workdir}/prometheus.log", "rb") as log:
        return log.read()[-num_bytes:].decode(errors="replace")
