"""The daemon's metrics pass promtool, and every dashboard query has series on an idle daemon (issue #39).

A series that appears only at its first event leaves a panel empty ("No data") and an alert on
``increase()`` blind to that first event; a lint problem is what promtool reports in CI. Both are
checked against a real idle daemon and, for the queries, a real Prometheus scraping it.
"""

import ast
import json
import pathlib
import re
import shutil
import tempfile

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.client import DaemonProcess
from kvxferd.service.base import metrics as m
from tests.deploy.prometheus import lint_metrics, prometheus, promtool, run_promtool, running_prometheus

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET_LABELS = {"namespace": "kvx-test", "pod": "kvxferd-idle-0"}  # what Kubernetes discovery adds
RATE_INTERVAL = "10s"  # for $__rate_interval: several 1 s scrapes
# Grafana's variables as a query sees them: "All" pods and namespaces match every value.
VARIABLES = {"$__rate_interval": RATE_INTERVAL, "$namespace": ".*", "$pod": ".*"}
BAD_PAGE = ("# HELP ok_bytes_total fine\n# TYPE ok_bytes_total counter\nok_bytes_total 1.0\n"
            "# HELP reads read\n# TYPE reads counter\nreads 1.0\n"  # a counter without _total
            "# TYPE quiet gauge\nquiet 1.0\n")  # no HELP
# The label values each labelled metric exists with from start-up (Metrics._create_series).
CREATED = {"kvxferd_read_duration_seconds": {("outcome",): {(v,) for v in m.OUTCOMES}},
           "kvxferd_handshake_duration_seconds": {("outcome",): {(v,) for v in m.OUTCOMES}},
           "kvxferd_read_failures": {("kind",): {(v,) for v in m.FAILURE_KINDS}},
           "kvxferd_notify_events": {("kind",): {(v,) for v in m.EVENT_KINDS}},
           "kvxferd_notices_dropped": {("reason",): {(v,) for v in m.DROPPED_NOTICES}},
           "kvxferd_fd_socket_refused": {("reason",): {(v,) for v in m.FD_REFUSALS}},
           "kvxferd_bus_subscriptions_refused": {("reason",): {(v,) for v in m.BUS_REFUSALS}},
           "kvxferd_push_duration_seconds": {("outcome",): {(v,) for v in m.OUTCOMES}},
           "kvxferd_push_writes": {("outcome",): {(v,) for v in m.PUSH_OUTCOMES}},
           "kvxferd_rpc_errors": {("method", "code"): {(v, m.RPC_INITIAL_CODE) for v in m.RPC_METHODS}}}


@pytest.fixture(scope="module")
def daemon():
    workdir = tempfile.mkdtemp(prefix="kvx")  # a short path for the UNIX sockets
    process = DaemonProcess("prom-idle", socket_dir=workdir)
    yield process
    assert process.terminate() == 0
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def page(daemon) -> str:
    return daemon.metrics_text()


def test_promtool_finds_no_problem_in_an_idle_daemons_metrics(page):
    if promtool() is None:
        pytest.skip("promtool not installed (scripts/system-deps.sh; test_python_lint_* checks the same rules)")
    clean = run_promtool("check", "metrics", stdin=page)
    assert (clean.returncode, clean.stdout + clean.stderr) == (0, "")
    bad = run_promtool("check", "metrics", stdin=BAD_PAGE)  # the control: promtool does report problems
    assert bad.returncode != 0
    assert 'reads counter metrics should have "_total" suffix' in bad.stdout + bad.stderr
    assert "quiet no help text" in bad.stdout + bad.stderr


def test_python_lint_finds_no_problem_in_an_idle_daemons_metrics(page):
    assert "_created" not in page
    assert lint_metrics(page) == []


def test_python_lint_reports_each_problem(page):
    """The control: each rule fires on a page that breaks it (and promtool agrees where it checks)."""
    created = page.replace("# HELP kvxferd_read_bytes_total", "kvxferd_read_bytes_created 1.7e9\n"
                                                                   "# HELP kvxferd_read_bytes_total")
    assert lint_metrics(created) == ['kvxferd_read_bytes_created is a "_created" series']
    odd = ("# HELP a:b x\n# TYPE a:b gauge\na:b 1\n# HELP lat_milliseconds x\n# TYPE lat_milliseconds gauge\n"
           "lat_milliseconds 1\n# HELP up_total x\n# TYPE up_total gauge\nup_total 1\n")
    problems = lint_metrics(BAD_PAGE + odd)
    assert problems == ["a:b metric names should not contain ':'", 'lat_milliseconds use base unit instead of '
                        '"milliseconds"', "quiet no help text", 'reads counter metrics should have "_total" suffix',
                        'up_total non-counter metrics should not have "_total" suffix']
    if promtool() is not None:
        reported = run_promtool("check", "metrics", stdin=BAD_PAGE + odd).stderr
        assert {line.split()[0] for line in reported.splitlines()} == {p.split()[0] for p in problems}


def test_an_idle_daemon_exports_build_info_process_series_and_every_label_value(page):
    families = {family.name: family for family in text_string_to_metric_families(page)}
    [build] = families["kvxferd_build_info"].samples
    assert build.value == 1 and build.labels == m.build_labels() and build.labels["version"] != "none"
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "process_max_fds",
                 "process_start_time_seconds", "python_info", "python_gc_collections"):
        assert families[name].samples, name
    for name, created in CREATED.items():
        [(labels, values)] = created.items()
        exported = {tuple(s.labels[label] for label in labels) for s in families[name].samples
                    if s.name in (name + "_total", name + "_count")}
        assert exported == values, name


def _string_args(node: ast.Call, *positions: int) -> set[str]:
    args = [node.args[i] for i in positions if i < len(node.args)]
    return {c.value for arg in args for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def test_every_label_value_the_code_passes_exists_from_start_up():
    """Literal label values in kvxferd's calls (``labels("ok" if ... else "failed")``, the fd inbox's and the
    bus's refusal reasons) are among those created at start-up; enum-valued ones come from the enums."""
    metric_of = {attr: wrapper._name for attr, wrapper in vars(m.Metrics()).items() if hasattr(wrapper, "_labelnames")}
    passed: dict[str, set[str]] = {}
    for path in (ROOT / "kvxferd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "labels" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in metric_of:
                passed.setdefault(metric_of[node.func.value.attr], set()).update(_string_args(node, 0))
    created = {name: {values[0] for values in next(iter(labels.values()))} for name, labels in CREATED.items()}
    for name, values in passed.items():  # the first label's: rpc_errors' codes are created only in part
        assert values <= created.get(name, set()), name
    assert passed["kvxferd_read_duration_seconds"] == set(m.OUTCOMES)
    fd_reasons, bus_reasons = set(), set()
    for node in ast.walk(ast.parse((ROOT / "kvxferd/service/engines/fdpass.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            fd_reasons |= _string_args(node, {"on_refused": 0, "_refuse": 1}.get(node.func.attr, 99))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and \
                any(isinstance(t, ast.Name) and t.id == "refusal" for t in node.targets):
            fd_reasons.add(node.value.elts[0].value)
    for node in ast.walk(ast.parse((ROOT / "kvxferd/service/net/bus.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_refuse":
            bus_reasons |= _string_args(node, 0)
    assert fd_reasons == set(m.FD_REFUSALS)
    assert bus_reasons == set(m.BUS_REFUSALS)


def _dashboard_queries() -> tuple[list[str], list[tuple[str, str]]]:
    """Every panel's expr with Grafana's variables filled in, and each variable's (selector, label)."""
    board = json.loads((ROOT / "deploy/grafana/kvxferd.json").read_text())
    def fill(expr: str) -> str:
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        return expr

    exprs = [fill(t["expr"]) for panel in board["panels"] for t in panel["targets"]]
    variables = [re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"]["query"]).groups()
                 for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs, [(fill(selector), label) for selector, label in variables]


@pytest.mark.skipif(prometheus() is None, reason="prometheus not installed (scripts/system-deps.sh installs it)")
def test_every_dashboard_query_has_series_on_an_idle_daemon(daemon):
    exprs, variables = _dashboard_queries()
    target = daemon.addresses["metrics"].removeprefix("http://").removesuffix("/metrics")
    with running_prometheus([target], labels=TARGET_LABELS) as prom:
        prom.wait_for(f"count_over_time(up[{RATE_INTERVAL}]) >= 2")  # rate() needs two samples
        assert [expr for expr in exprs if not prom.query(expr)] == []
        for selector, label in variables:
            assert prom.label_values(label, selector) == [TARGET_LABELS[label]], selector
        # The controls: a label value no series has yet, a metric nobody exports, a variable's label
        # no target has: each returns nothing, so the check above can fail.
        unseen = f'sum by (code) (rate(kvxferd_rpc_errors_total{{code="UNAVAILABLE"}}[{RATE_INTERVAL}]))'
        assert prom.query(unseen) == []
        assert prom.query(f"sum(rate(kvxferd_no_such_metric_total[{RATE_INTERVAL}]))") == []
        assert prom.label_values("cluster", "kvxferd_engines_registered") == []
