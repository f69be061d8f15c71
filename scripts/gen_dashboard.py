#!/usr/bin/env python3
"""Write deploy/grafana/kvxferd.json: one panel per question an operator asks of the daemons."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RATE = "[$__rate_interval]"
SEL = '{namespace=~"$namespace", pod=~"$pod"}'
# process_* series come from every Python exporter in a pod (vLLM's too): keep those of the scrape
# targets (job, instance) that are kvxferd daemons, the ones exporting kvxferd_build_info.
DAEMONS = " and on (job, instance) kvxferd_build_info"

# (title, unit, [(legend, PromQL)]); every series comes from kvxferd/service/base/metrics.py.
PANELS = [
    ("Read throughput", "Bps", [("{{pod}}", f"sum by (pod) (rate(kvxferd_read_bytes_total{SEL}{RATE}))")]),
    ("Reads completed / s by outcome", "ops", [
        ("{{outcome}}", f"sum by (outcome) (rate(kvxferd_read_duration_seconds_count{SEL}{RATE}))")]),
    ("Read duration p50 / p99 (submit -> completion)", "s", [
        ("p50", f"histogram_quantile(0.5, sum by (le) (rate(kvxferd_read_duration_seconds_bucket{SEL}{RATE})))"),
        ("p99", f"histogram_quantile(0.99, sum by (le) (rate(kvxferd_read_duration_seconds_bucket{SEL}{RATE})))")]),
    ("Post time p50 / p99 (submit -> every rank posted)", "s", [
        ("p50", f"histogram_quantile(0.5, sum by (le) (rate(kvxferd_read_post_seconds_bucket{SEL}{RATE})))"),
        ("p99", f"histogram_quantile(0.99, sum by (le) (rate(kvxferd_read_post_seconds_bucket{SEL}{RATE})))")]),
    ("Failed reads / s by kind", "ops", [("{{kind}}", f"sum by (kind) (rate(kvxferd_read_failures_total{SEL}{RATE}))")]),
    ("Integrity (issue #59): bytes of reads checked against their holds' digests / s (corrupt ones: failed reads, "
     "kind corrupt)", "Bps", [("{{pod}}", f"sum by (pod) (rate(kvxferd_digest_checked_bytes_total{SEL}{RATE}))")]),
    ("Push (prefill side): writes / s by outcome, bytes written / s, stages / s", "ops", [
        ("{{outcome}}", f"sum by (outcome) (rate(kvxferd_push_writes_total{SEL}{RATE}))"),
        ("bytes {{pod}}", f"sum by (pod) (rate(kvxferd_push_bytes_total{SEL}{RATE}))"),
        ("layer-by-layer stages {{pod}}", f"sum by (pod) (rate(kvxferd_push_stages_total{SEL}{RATE}))"),
        ("expectations kept {{pod}}", f"sum by (pod) (kvxferd_push_expectations{SEL})")]),
    ("Push (decode side): expectation submit -> completion p50 / p99", "s", [
        ("p50", f"histogram_quantile(0.5, sum by (le) (rate(kvxferd_push_duration_seconds_bucket{SEL}{RATE})))"),
        ("p99", f"histogram_quantile(0.99, sum by (le) (rate(kvxferd_push_duration_seconds_bucket{SEL}{RATE})))")]),
    ("Copied same-host (not over NIXL) / s: rank reads, and pushes' writes", "ops", [
        ("reads {{pod}}", f"sum by (pod) (rate(kvxferd_same_host_copies_total{SEL}{RATE}))"),
        ("push writes {{pod}}", f"sum by (pod) (rate(kvxferd_push_same_host_copies_total{SEL}{RATE}))")]),
    ("Transport paths: READs by path UCX chose (emulated, tcp: slow) and GPU regions by what can serve them",
     "short", [
        ("{{memory}} {{path}}", f"sum by (memory, path) (kvxferd_transport_paths{SEL})"),
        ("VRAM regions: {{kind}}", f"sum by (kind) (kvxferd_vram_regions{SEL})")]),
    ("Descriptors per read (p50)", "short", [
        ("p50", f"histogram_quantile(0.5, sum by (le) (rate(kvxferd_read_descriptors_bucket{SEL}{RATE})))")]),
    ("Reads in flight / holds pending", "short", [
        ("reads in flight", f"sum(kvxferd_reads_in_flight{SEL})"), ("holds pending", f"sum(kvxferd_holds_pending{SEL})")]),
    ("Notify events / s", "ops", [("{{kind}}", f"sum by (kind) (rate(kvxferd_notify_events_total{SEL}{RATE}))")]),
    ("Readers' notices that waited for the holder (fast polls) / s", "ops", [
        ("{{pod}}", f"sum by (pod) (rate(kvxferd_waited_notices_total{SEL}{RATE}))")]),
    ("Leases expired, stale reads, late notices and unsettled reads / s", "ops", [
        ("leases expired", f"sum(rate(kvxferd_leases_expired_total{SEL}{RATE}))"),
        ("stale reads", f"sum(rate(kvxferd_stale_reads_total{SEL}{RATE}))"),
        ("late notices", f"sum(rate(kvxferd_late_notices_total{SEL}{RATE}))"),
        ("unsettled failed reads", f"sum(rate(kvxferd_unsettled_reads_total{SEL}{RATE}))")]),
    ("Handshakes p99 by outcome", "s", [
        ("{{outcome}}", f"histogram_quantile(0.99, sum by (le, outcome) (rate(kvxferd_handshake_duration_seconds_bucket{SEL}{RATE})))")]),
    ("RPC errors / s", "ops", [("{{method}} {{code}}", f"sum by (method, code) (rate(kvxferd_rpc_errors_total{SEL}{RATE}))")]),
    ("Engines registered", "short", [("{{pod}}", f"sum by (pod) (kvxferd_engines_registered{SEL})")]),
    ("Data plane woken by sockets: UCX socket sets, and sets muted (firing with nothing to do)", "short", [
        ("socket sets ({{pod}})", f"max by (pod) (kvxferd_wake_sets{SEL})"),
        ("mutes ({{pod}})", f"max by (pod) (kvxferd_wake_set_mutes{SEL})")]),
    ("Event-loop stalls / s (late by over 0.25 s)", "ops", [
        ("{{pod}}", f"sum by (pod) (rate(kvxferd_loop_stalls_total{SEL}{RATE}))")]),
    ("Security: refused and dropped / s", "ops", [
        ("notices dropped ({{reason}})", f"sum by (reason) (rate(kvxferd_notices_dropped_total{SEL}{RATE}))"),
        ("fd socket refused ({{reason}})", f"sum by (reason) (rate(kvxferd_fd_socket_refused_total{SEL}{RATE}))"),
        ("bus subscriptions refused ({{reason}})",
         f"sum by (reason) (rate(kvxferd_bus_subscriptions_refused_total{SEL}{RATE}))"),
        ("peer connections closed past the per-source cap",
         f"sum(rate(kvxferd_peer_connections_closed_total{SEL}{RATE}))")]),
    ("Security: insecure listeners and TLS reloads", "short", [
        ("insecure listeners ({{pod}})", f"max by (pod) (kvxferd_insecure_listeners{SEL})"),
        ("TLS reloads ({{pod}})", f"max by (pod) (kvxferd_tls_reloads_total{SEL})"),
        ("TLS certificates refused ({{pod}})", f"max by (pod) (kvxferd_tls_refused_total{SEL})"),
        ("TLS files unusable ({{pod}})", f"max by (pod) (kvxferd_tls_files_unusable{SEL})")]),
    ("Data-plane workers: deaths, replacements and sessions handed / s, ranks given up", "short", [
        ("deaths ({{pod}})", f"sum by (pod) (rate(kvxferd_dataplane_worker_deaths_total{SEL}{RATE}))"),
        ("replaced: {{reason}}",
         f"sum by (reason) (rate(kvxferd_dataplane_worker_replacements_total{SEL}{RATE}))"),
        ("ranks given up ({{pod}})", f"max by (pod) (kvxferd_dataplane_workers_given_up{SEL})"),
        ("reads sessions handed to reader workers ({{pod}})",
         f"sum by (pod) (rate(kvxferd_reader_worker_sessions_total{SEL}{RATE}))")]),
    ("Daemons by version", "short", [
        ("kvxferd {{version}}, Python {{python}}, NIXL {{nixl}}",
         f"count by (version, python, nixl) (kvxferd_build_info{SEL})")]),
    ("Daemon CPU (cores)", "short", [
        ("{{pod}}", f"sum by (pod) (rate(process_cpu_seconds_total{SEL}{RATE}){DAEMONS})")]),
    ("Daemon resident memory", "bytes", [
        ("{{pod}}", f"sum by (pod) (process_resident_memory_bytes{SEL}{DAEMONS})")]),
    ("Daemon open fds (of its limit)", "percentunit", [
        ("{{pod}}", f"max by (pod) (process_open_fds{SEL} / process_max_fds{SEL}{DAEMONS})")]),
]


def panel(n: int, title: str, unit: str, targets) -> dict:
    return {"id": n + 1, "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (n % 2), "y": 8 * (n // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend}
                        for i, (legend, expr) in enumerate(targets)]}


def variable(name: str, query: str) -> dict:
    return {"name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "includeAll": True, "multi": True, "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict:
    return {"title": "kvxferd", "uid": "kvxferd", "schemaVersion": 39, "version": 1, "editable": True,
            "tags": ["kvxferd", "nixl", "kv-cache"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
            "templating": {"list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
                variable("namespace", "label_values(kvxferd_engines_registered, namespace)"),
                variable("pod", 'label_values(kvxferd_engines_registered{namespace=~"$namespace"}, pod)')]},
            "panels": [panel(n, *spec) for n, spec in enumerate(PANELS)]}


if __name__ == "__main__":
    path = ROOT / "deploy/grafana/kvxferd.json"
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
