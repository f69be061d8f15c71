"""The chart's PrometheusRule: promtool accepts it, each alert fires on what it names and not otherwise,
and a real Prometheus evaluates it against a real daemon (issue #39).

The rules are the chart's own render (release ``kvx`` in namespace ``serving``), so the label
selectors are the ones a cluster would run. ``promtool test rules`` feeds each alert synthetic series
(a failure ratio above and below its threshold); the real server scrapes an idle daemon under the
labels Kubernetes discovery gives a pod, where no alert may be pending, then the daemon stops and
KvxferdDaemonDown must go pending.
"""

import re
import shutil
import tempfile
import time

import pytest
import yaml

from kvxferd.client import DaemonProcess
from kvxferd.service.reference import exported_series
from kvxferd.rig.verify import chart
from tests.deploy.prometheus import prometheus, promtool, run_promtool, running_prometheus

RELEASE, NAMESPACE = "kvx", "serving"
# The labels the Prometheus Operator gives a series its PodMonitor scraped (job: <namespace>/<PodMonitor>).
POD = {"namespace": NAMESPACE, "job": f"{NAMESPACE}/kvx-kvxferd-prefill", "pod": "kvx-kvxferd-prefill-5d8f-x2",
       "container": "kvxferd-0"}
# What the issue asks alerts for, by the alert that covers it.
REQUIRED = {"daemon down": "KvxferdDaemonDown", "stale reads": "KvxferdStaleReads",
            "holds expiring instead of consumed": "KvxferdHoldsExpiring", "loop stalls": "KvxferdLoopStalls",
            "TLS reload failures": "KvxferdTLSReloadRefused", "TLS files unusable": "KvxferdTLSFilesUnusable", "notices dropped": "KvxferdNoticesDropped",
            "transfer failure ratio": "KvxferdTransferFailures", "worker deaths": "KvxferdDataplaneWorkerDeaths",
            "a worker that cannot start": "KvxferdDataplaneWorkerCannotStart", "corrupt reads": "KvxferdCorruptReads"}

needs_promtool = pytest.mark.skipif(promtool() is None, reason="promtool not installed (scripts/system-deps.sh)")


def _rule_groups(values=None) -> dict:
    (rule,) = [o for o in chart.render_objects(values, release=RELEASE, namespace=NAMESPACE)
               if o["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def _alerts(groups) -> dict[str, dict]:
    return {r["alert"]: r for group in groups["groups"] for r in group["rules"]}


@pytest.fixture()
def rule_file(tmp_path):
    path = tmp_path / "kvxferd-rules.yaml"
    path.write_text(yaml.safe_dump(_rule_groups()))
    return path


def test_every_alert_the_issue_asks_for_and_only_exported_series():
    alerts = _alerts(_rule_groups())
    assert set(REQUIRED.values()) <= alerts.keys()
    exported = {name for names in exported_series().values() for name in names}
    for name, rule in alerts.items():
        used = set(re.findall(r"\b(kvxferd_\w+)\{", rule["expr"]))
        assert used <= exported, (name, used - exported)
        # This release's PodMonitors only: another release's pods may share the name prefix.
        assert f'namespace="{NAMESPACE}", job=~"{NAMESPACE}/(kvx-kvxferd-decode|kvx-kvxferd-prefill)"' in rule["expr"]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_alerts_follow_their_values():
    alerts = _alerts(_rule_groups({"prometheusRule": {"failureRatio": 0.25, "for": "3m", "rateWindow": "2m"}}))
    failures = alerts["KvxferdTransferFailures"]
    assert failures["expr"].endswith("> 0.25") and failures["for"] == "3m" and "[2m]" in failures["expr"]
    objects = chart.render_objects({"prometheusRule": {"enabled": False}})
    assert "PrometheusRule" not in {o["kind"] for o in objects}


@needs_promtool
def test_promtool_accepts_the_rules_and_refuses_a_broken_one(rule_file, tmp_path):
    checked = run_promtool("check", "rules", str(rule_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 13 rules found" in checked.stdout
    broken = _rule_groups()
    broken["groups"][0]["rules"][1]["expr"] = "sum by (pod) (rate(kvxferd_read_bytes_total[5m]) >"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    assert run_promtool("check", "rules", str(tmp_path / "broken.yaml")).returncode != 0


def _series(name: str, labels: dict, values: str) -> dict:
    selector = ", ".join(f'{k}="{v}"' for k, v in {**POD, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


# Per test case: input series (values in promtool's expanding notation, one sample a minute), the
# alert, and its summary 20 minutes in (past every `for`), or None where it must not fire.
P = POD["pod"]
CASES = {
    "failures above the ratio": ([_series("kvxferd_read_duration_seconds_count", {"outcome": "ok"}, "0+90x30"),
                                  _series("kvxferd_read_duration_seconds_count", {"outcome": "failed"}, "0+10x30")],
                                 "KvxferdTransferFailures", f"{P}: 10% of reads failed"),
    "failures below the ratio": ([_series("kvxferd_read_duration_seconds_count", {"outcome": "ok"}, "0+99x30"),
                                  _series("kvxferd_read_duration_seconds_count", {"outcome": "failed"}, "0+1x30")],
                                 "KvxferdTransferFailures", None),
    "holds expiring": ([_series("kvxferd_notify_events_total", {"kind": "CONSUMED"}, "0+5x30"),
                        _series("kvxferd_notify_events_total", {"kind": "EXPIRED"}, "0+5x30"),
                        _series("kvxferd_leases_expired_total", {}, "0+5x30")],
                       "KvxferdHoldsExpiring", f"{P}: 50% of holds expired instead of being consumed"),
    # Holds their engine released (an aborted request, an early hold sent again) end EXPIRED with reason
    # "released": no lease ran out, nothing was pinned and wasted.
    "holds released": ([_series("kvxferd_notify_events_total", {"kind": "CONSUMED"}, "0+5x30"),
                        _series("kvxferd_notify_events_total", {"kind": "EXPIRED"}, "0+5x30"),
                        _series("kvxferd_leases_expired_total", {}, "0x30")],
                       "KvxferdHoldsExpiring", None),
    "holds consumed": ([_series("kvxferd_notify_events_total", {"kind": "CONSUMED"}, "0+50x30"),
                        _series("kvxferd_notify_events_total", {"kind": "EXPIRED"}, "0+1x30"),
                        _series("kvxferd_leases_expired_total", {}, "0+1x30")],
                       "KvxferdHoldsExpiring", None),
    "stale reads": ([_series("kvxferd_stale_reads_total", {}, "0+1x30")], "KvxferdStaleReads",
                    f"{P}: reads found their hold gone (blocks invalid)"),
    "no stale reads": ([_series("kvxferd_stale_reads_total", {}, "0x30")], "KvxferdStaleReads", None),
    "a corrupt read": ([_series("kvxferd_read_failures_total", {"kind": "corrupt"}, "0x16 1x14")],
                       "KvxferdCorruptReads", f"{P}: blocks a read wrote differ from the holder's digests"),
    "stale reads are not corrupt": ([_series("kvxferd_read_failures_total", {"kind": "stale"}, "0+1x30")],
                                    "KvxferdCorruptReads", None),
    "a certificate refused": ([_series("kvxferd_tls_refused_total", {}, "0x15 1x15")], "KvxferdTLSReloadRefused",
                              f"{P}: a rotated TLS certificate was refused"),
    "TLS files unusable": ([_series("kvxferd_tls_files_unusable", {}, "0x5 1x25")], "KvxferdTLSFilesUnusable",
                           f"{P}: the TLS files on disk cannot be loaded"),
    "TLS files unusable for a moment": ([_series("kvxferd_tls_files_unusable", {}, "0x5 1 0x24")],
                                        "KvxferdTLSFilesUnusable", None),
    "worker deaths": ([_series("kvxferd_dataplane_worker_deaths_total", {}, "0x16 1x14")],
                      "KvxferdDataplaneWorkerDeaths", f"{P}: data-plane workers died"),
    "no worker deaths": ([_series("kvxferd_dataplane_worker_deaths_total", {}, "0x30")],
                         "KvxferdDataplaneWorkerDeaths", None),
    "a worker that cannot start": ([_series("kvxferd_dataplane_workers_given_up", {}, "0x10 1x20")],
                                   "KvxferdDataplaneWorkerCannotStart",
                                   f"{P}: an engine rank's data-plane worker cannot start again"),
    "daemon down": ([_series("up", {}, "1x5 0x25")], "KvxferdDaemonDown",
                    f"kvxferd daemon {P}/{POD['container']} is not scraped"),
    "daemon up": ([_series("up", {}, "1x30")], "KvxferdDaemonDown", None),
    "another namespace's stale reads": ([_series("kvxferd_stale_reads_total", {"namespace": "other"}, "0+1x30")],
                                        "KvxferdStaleReads", None),
    # Release kvx-kvxferd-canary's pods match kvx-kvxferd-.+ too: its job tells them apart.
    "another release's stale reads": ([_series("kvxferd_stale_reads_total", {
        "job": f"{NAMESPACE}/kvx-kvxferd-canary-prefill", "pod": "kvx-kvxferd-canary-prefill-7c-x1"}, "0+1x30")],
        "KvxferdStaleReads", None),
}


@needs_promtool
def test_each_alert_fires_on_its_condition_and_not_otherwise(rule_file, tmp_path):
    rules = _alerts(_rule_groups())
    tests = []
    for case, (series, alert, summary) in CASES.items():
        expected = []
        if summary is not None:
            rule = rules[alert]
            # sum by (namespace, pod) keeps those two labels; up's alert keeps the container too.
            labels = {k: v for k, v in POD.items() if k in ("namespace", "pod") or alert == "KvxferdDaemonDown"}
            expected = [{"exp_labels": {**labels, "severity": rule["labels"]["severity"]},
                         "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]}}]
        tests.append({"name": case, "interval": "1m", "input_series": series,
                      "alert_rule_test": [{"eval_time": "20m", "alertname": alert, "exp_alerts": expected}]})
    test_file = tmp_path / "tests.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests}))
    result = run_promtool("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr
    # The control: the same file expecting the wrong outcome of one case fails.
    tests[1]["alert_rule_test"][0]["exp_alerts"] = tests[0]["alert_rule_test"][0]["exp_alerts"]
    test_file.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": tests}))
    assert run_promtool("test", "rules", str(test_file)).returncode != 0


def _all_evaluated(groups) -> bool:
    """Every rule evaluated at least once (an unevaluated rule's time is Go's zero, year 0001)."""
    return all(r.get("lastEvaluation", "0001").startswith("2") for g in groups for r in g["rules"])


@pytest.mark.skipif(prometheus() is None, reason="prometheus not installed (scripts/system-deps.sh)")
def test_a_real_prometheus_evaluates_every_rule_against_a_daemon(rule_file):
    workdir = tempfile.mkdtemp(prefix="kvx")
    daemon = DaemonProcess("alerts-idle", socket_dir=workdir)
    try:
        target = daemon.addresses["metrics"].removeprefix("http://").removesuffix("/metrics")
        labels = {k: v for k, v in POD.items() if k != "job"}
        with running_prometheus([target], labels=labels, rule_files=(str(rule_file),), job=POD["job"]) as prom:
            prom.wait_for('kvxferd_build_info{namespace="serving"}')
            prom.wait_for("up == 1")
            deadline = time.monotonic() + 10
            while not _all_evaluated(groups := prom.rules()):
                assert time.monotonic() < deadline, groups
                time.sleep(0.2)
            assert [(r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]
                    if r["health"] != "ok"] == []
            assert prom.alerts() == []  # an idle daemon raises nothing
            assert daemon.terminate() == 0
            daemon = None
            prom.wait_for("up == 0")
            deadline = time.monotonic() + 10
            while not (pending := [(a["labels"]["alertname"], a["state"]) for a in prom.alerts()]):
                assert time.monotonic() < deadline, "KvxferdDaemonDown did not go pending"
                time.sleep(0.2)
            assert pending == [("KvxferdDaemonDown", "pending")]  # for: 2m before it fires
    finally:
        if daemon is not None:
            daemon.terminate()
        shutil.rmtree(workdir, ignore_errors=True)
