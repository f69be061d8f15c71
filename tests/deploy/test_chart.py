"""The Helm chart, rendered by Helm's own engine, makes valid Kubernetes objects that run kvxferd as the docs say.

Every values file under the chart's ``ci/`` is linted (``helm lint --strict``),
rendered, and each built-in object is validated against the Kubernetes 1.37
schemas (strict: unknown fields fail). The kvxferd containers' arguments and
config file are parsed by kvxferd's own CLI and config schema.
"""

import pathlib

import helm_python
import kubernetes_validate
import pytest
import yaml

from kvxferd.cli import build_parser
from kvxferd.service.base.config import config_from_args
from kvxferd.service.net.exposure import refusal
from kvxferd.rig.verify import chart

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = chart.CHART
K8S_VERSION = "1.37.0"
CRD_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/")  # checked by their own tests below
VALUES_FILES = chart.ci_values()


def _render(values=None, **release):
    objects = chart.render_objects(values, **release)
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    return objects, by_kind


def _validate(obj):
    if not obj["apiVersion"].startswith(CRD_GROUPS):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _all_containers(pod) -> list[dict]:
    """The pod's init containers (the daemons, as native sidecars) and its containers."""
    return pod.get("initContainers", []) + pod["containers"]


def _sidecars(deployment):
    return [c for c in _all_containers(deployment["spec"]["template"]["spec"]) if c["name"].startswith("kvxferd-")]


def _roles(values):
    """The enabled roles as the chart sees them: values.yaml's roles with ``values`` merged over them."""
    roles = yaml.safe_load((CHART / "values.yaml").read_text())["roles"]
    for name, override in ((values or {}).get("roles") or {}).items():
        roles[name] = {**roles.get(name, {}), **override}
    return {name: role for name, role in roles.items() if role["enabled"]}


def _daemon_config(container, config_text, tmp_path, monkeypatch, pod_name="decode-7d9f-x2"):
    """What a kvxferd container would run with, with Kubernetes' $(VAR) expansion done by hand."""
    path = tmp_path / "kvxferd.yaml"
    path.write_text(config_text)
    monkeypatch.setenv("KVXFERD_ADVERTISE_HOST", "10.1.2.3")
    argv = [a.replace("$(POD_NAME)", pod_name).replace("/etc/kvxferd/kvxferd.yaml", str(path)) for a in container["args"]]
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("name", VALUES_FILES)
def test_helm_lint_is_clean(name):
    assert chart.lint(VALUES_FILES[name]) == []


def test_helm_lint_reports_a_broken_chart():
    findings = chart.lint({"roles": {"prefill": {"tensorParallelSize": "two"}}})
    assert any("tensorParallelSize" in f["error"] for f in findings)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_every_values_file_renders_valid_objects(name):
    objects, by_kind = _render(VALUES_FILES[name])
    for obj in objects:
        _validate(obj)
    roles = _roles(VALUES_FILES[name])
    assert sorted(d["metadata"]["labels"]["app.kubernetes.io/component"] for d in by_kind["Deployment"]) == sorted(roles)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))
    assert not any("kvxferd-kvxferd" in n for _, n in names)  # release "kvxferd" is not repeated


def test_the_validator_rejects_a_broken_object():
    _, by_kind = _render()
    deployment = by_kind["Deployment"][0]
    _sidecars(deployment)[0]["livenessProbe"]["exec"]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values, where", [
    ({"roles": {"prefill": {"tensorParallelSize": 2.5}}}, "/roles/prefill/tensorParallelSize"),
    ({"roles": [{"name": "prefill", "enabled": True, "replicas": 1, "tensorParallelSize": 2}]}, "/roles"),  # the old list
    ({"role": {"prefill": {}}}, "role"),
    ({"gpu": {"allocation": "mig"}}, "/gpu/allocation"),
    ({"ports": {"ucx": {"max": 70000}}}, "/ports/ucx/max"),
    ({"roles": {"Prefill": {"enabled": True, "replicas": 1, "tensorParallelSize": 1}}}, "Prefill. does not match"),
    ({"tls": {"allowedIds": ["ns/*"]}}, "/tls/allowedIds/0"),
    ({"tls": {"allowedIds": ["dns:spiffe://cluster.local/ns/a/sa/b"]}}, "/tls/allowedIds/0"),  # URIs only (#53)
    ({"tracing": {"otlpEndpoint": "otel-collector:4317"}}, "/tracing/otlpEndpoint"),  # a URL: http(s)://
])
def test_the_values_schema_refuses_bad_values(values, where):
    with pytest.raises(helm_python.HelmValuesError, match=where):
        chart.render_manifests(values)


def test_a_role_is_turned_off_by_name_with_set():
    _, by_kind = _render(helm_python.parse_set_string("roles.prefill.enabled=false,roles.decode.replicas=4"))
    (deployment,) = by_kind["Deployment"]
    assert deployment["metadata"]["name"] == "kvxferd-decode" and deployment["spec"]["replicas"] == 4
    assert [s["metadata"]["name"] for s in by_kind["Service"]] == ["kvxferd-decode-peers"]


@pytest.mark.parametrize("values, release, prefix", [
    (None, "kvxferd", "kvxferd"), (None, "kvx", "kvx-kvxferd"), (None, "prod-kvxferd-a", "prod-kvxferd-a"),
    ({"nameOverride": "kv"}, "serving", "serving-kv"), ({"fullnameOverride": "kv"}, "serving", "kv")])
def test_names_follow_the_release_and_overrides(values, release, prefix):
    _, by_kind = _render(values, release=release)
    assert {d["metadata"]["name"] for d in by_kind["Deployment"]} == {f"{prefix}-prefill", f"{prefix}-decode"}
    assert by_kind["ConfigMap"][0]["metadata"]["name"] == f"{prefix}-config"


@pytest.mark.parametrize("name", VALUES_FILES)
def test_one_daemon_per_gpu_that_kvxferd_itself_accepts(name, tmp_path, monkeypatch):
    values = VALUES_FILES[name]
    _, by_kind = _render(values)
    config_text = by_kind["ConfigMap"][0]["data"]["kvxferd.yaml"]
    roles = _roles(values)
    for deployment in by_kind["Deployment"]:
        role = roles[deployment["metadata"]["labels"]["app.kubernetes.io/component"]]
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["replicas"] == role["replicas"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        sidecars = _sidecars(deployment)
        assert len(sidecars) == role["tensorParallelSize"]
        ports = [p["containerPort"] for c in _all_containers(pod) for p in c["ports"]]
        assert len(ports) == len(set(ports))
        for gpu, container in enumerate(sidecars):
            env = {e["name"]: e for e in container["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["KVXFERD_ADVERTISE_HOST"]["value"] == "$(POD_IP)"
            config = _daemon_config(container, config_text, tmp_path, monkeypatch)
            assert config.peer_address == f"10.1.2.3:{container['ports'][0]['containerPort']}"
            assert config.engine_socket == f"/run/kvxferd/gpu{gpu}.sock" and config.daemon_id == f"decode-7d9f-x2-gpu{gpu}"
            assert config.peer_host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
            assert config.notify_host == "127.0.0.1"  # the engine is in the pod: the bus never leaves it
            assert config.notify_port == 47200 + gpu and config.metrics_port == container["ports"][1]["containerPort"]
            # Mutual TLS, or the explicit --insecure of development values: kvxferd starts on either.
            assert refusal(config) is None and config.tls != config.insecure
            engine_socket = f"unix:/run/kvxferd/gpu{gpu}.sock"
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                # grpc.health.v1 over the engine socket: kubelet's gRPC probes cannot do mutual TLS.
                command = container[probe]["exec"]["command"]
                assert command[:4] == ["kvxferd", "health", "--target", engine_socket]
                assert build_parser().parse_args(command[1:]).target == engine_socket
            assert container["readinessProbe"]["exec"]["command"][-2:] == ["--service", "kvxfer.v1.PeerService"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/run/kvxferd", "/dev/shm", "/etc/kvxferd"} <= mounts
            assert ("/etc/kvxferd/tls" in mounts) == config.tls
        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        # One engine rank per daemon of the pod, listening where the probes and the policy expect it.
        assert engine["args"][-2:] == [f"--tensor-parallel-size={role['tensorParallelSize']}", "--port=8000"]
        assert engine["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= engine.keys()
        assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert pod["automountServiceAccountToken"] is False
        assert pod["terminationGracePeriodSeconds"] > yaml.safe_load(config_text)["drain_timeout_s"]


def test_gpus_from_dra_are_one_claim_shared_by_every_container():
    _, by_kind = _render()
    claims = {t["metadata"]["name"]: t for t in by_kind["ResourceClaimTemplate"]}
    for deployment in by_kind["Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        (claim,) = pod["resourceClaims"]
        request = claims[claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["requests"][0]
        assert request["exactly"]["count"] == len(_sidecars(deployment))
        assert all({"name": "gpus"} in c["resources"]["claims"] for c in _all_containers(pod))  # same GPUs for all


def test_gpus_from_the_device_plugin_go_to_the_engine_and_the_daemons_see_them():
    _, by_kind = _render(VALUES_FILES["device-plugin"])
    assert "ResourceClaimTemplate" not in by_kind
    for deployment in by_kind["Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        assert "resourceClaims" not in pod
        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        assert engine["resources"]["limits"] == {"nvidia.com/gpu": len(_sidecars(deployment)), "memory": "64Gi"}
        assert engine["resources"]["requests"] == {"cpu": "4", "memory": "32Gi"}
        for sidecar in _sidecars(deployment):
            assert "claims" not in sidecar["resources"] and "nvidia.com/gpu" not in str(sidecar["resources"])
            assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in sidecar["env"]
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_scheduling_values_reach_the_pods_and_a_role_can_replace_them():
    _, by_kind = _render(VALUES_FILES["tp-sizes"])
    selectors = {d["metadata"]["name"]: d["spec"]["template"]["spec"].get("nodeSelector") for d in by_kind["Deployment"]}
    assert selectors == {"kvxferd-decode": None, "kvxferd-prefill": None,
                         "kvxferd-decode-long": {"gpu.example.com/memory": "141Gi"}}
    _, by_kind = _render(VALUES_FILES["names"])
    for deployment in by_kind["Deployment"]:
        template = deployment["spec"]["template"]
        assert template["metadata"]["labels"]["team"] == "serving"
        assert template["metadata"]["annotations"]["example.com/owner"] == "serving"
        assert template["metadata"]["annotations"]["checksum/config"]
        assert template["spec"]["priorityClassName"] == "high-priority" and template["spec"]["affinity"]


def test_services_select_the_pods_and_name_their_ports():
    _, by_kind = _render()
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in by_kind["Deployment"]}
    for service in by_kind["Service"]:
        deployment = deployments[service["metadata"]["labels"]["app.kubernetes.io/component"]]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod_labels.items()
        # Numeric target ports, each a daemon's own peer port (a named port of a native sidecar resolves only
        # from Kubernetes 1.32/1.33 on)
        by_name = {p["name"]: p["containerPort"] for c in _sidecars(deployment) for p in c["ports"]}
        assert all(p["targetPort"] == by_name[p["name"]] for p in service["spec"]["ports"])


@pytest.mark.parametrize("name", ["default", "names"])
def test_pod_monitor_scrapes_every_daemon_and_prometheus_selects_it(name):
    _, by_kind = _render(VALUES_FILES[name])
    release_label = VALUES_FILES[name].get("podMonitor", {}).get("labels", {"release": "kube-prometheus-stack"})
    for monitor in by_kind["PodMonitor"]:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert release_label.items() <= monitor["metadata"]["labels"].items()
        deployment = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == monitor["metadata"]["name"])
        assert monitor["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        metrics_ports = {p["name"] for c in _sidecars(deployment) for p in c["ports"] if p["name"].startswith("metrics-")}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == metrics_ports


@pytest.mark.parametrize("name", ["default", "names"])
def test_a_disruption_budget_per_role(name):
    _, by_kind = _render(VALUES_FILES[name])
    budgets = {b["metadata"]["name"]: b for b in by_kind["PodDisruptionBudget"]}
    assert budgets.keys() == {d["metadata"]["name"] for d in by_kind["Deployment"]}
    for deployment in by_kind["Deployment"]:
        spec = budgets[deployment["metadata"]["name"]]["spec"]
        assert spec["selector"] == deployment["spec"]["selector"]
        assert spec["maxUnavailable"] == VALUES_FILES[name].get("podDisruptionBudget", {}).get("maxUnavailable", 1)


def test_committed_manifests_are_the_rendered_chart():
    committed = (ROOT / "deploy/kubernetes/kvxferd.yaml").read_text()
    assert committed.split("\n", 1)[1] == chart.render_stream(), \
        "deploy/kubernetes/kvxferd.yaml is stale: run scripts/render_chart.py"
    kinds = {doc["kind"] for doc in yaml.safe_load_all(committed) if doc}
    assert "Pod" not in kinds and "Deployment" in kinds  # no test hook for kubectl apply to run at once


@pytest.mark.parametrize("values, message", [
    ({"tls": {"enabled": False}}, "tls.enabled=false needs insecure=true"),
    ({"ports": {"ucx": None}}, "ports.ucx=null with networkPolicy.enabled"),
    ({"ports": {"ucx": {"min": 40100, "max": 40000}}}, "ports.ucx.min must not be above ports.ucx.max"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.create=false needs serviceAccount.name"),
])
def test_values_that_make_pods_that_cannot_work_are_refused(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render_manifests(values)


@pytest.mark.parametrize("values", [{"resources": None}, {"engine": {"resources": None}},
                                    {"resources": {"requests": None, "limits": None}},
                                    {"gpu": {"allocation": "devicePlugin"}, "engine": {"resources": None}}])
def test_empty_resources_still_render(values):
    objects, by_kind = _render(values)
    for obj in objects:
        _validate(obj)
    for deployment in by_kind["Deployment"]:
        for container in _all_containers(deployment["spec"]["template"]["spec"]):
            resources = container["resources"]
            assert resources.get("claims") == [{"name": "gpus"}] or "nvidia.com/gpu" in resources.get("limits", {}) \
                or container["name"] != "engine"


def test_names_over_63_characters_are_refused_not_cut():
    """Cutting <release>-kvxferd-<role> could give two roles one Service; Kubernetes refuses a longer one."""
    long_role = {"roles": {"decode-long-context": {"enabled": True, "replicas": 1, "tensorParallelSize": 1}}}
    objects, _ = _render(long_role, release="serving-east-1")
    assert max(len(o["metadata"]["name"]) for o in objects) <= 63
    with pytest.raises(helm_python.HelmRenderError, match="-kvxferd-decode-peers is over 63 characters"):
        chart.render_manifests(long_role, release="inference-serving-production-cluster-east-1")
    objects, _ = _render({**long_role, "fullnameOverride": "kv"}, release="inference-serving-production-cluster-east-1")
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Service"} == {
        "kv-decode-peers", "kv-prefill-peers", "kv-decode-long-context-peers"}


def test_an_empty_metrics_source_list_closes_the_metrics_ports():
    """An empty from admits every source in Kubernetes: with no scraper and no test, no rule at all."""
    _, by_kind = _render({"networkPolicy": {"metricsFrom": []}, "tests": {"enabled": False}})
    for policy in by_kind["NetworkPolicy"]:
        assert all(rule["from"] for rule in policy["spec"]["ingress"])
        ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert not ports & {9464, 9465}


def test_network_policy_admits_only_peers_monitoring_and_the_release_test():
    _, by_kind = _render()
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    (test_pod,) = by_kind["Pod"]
    for policy in by_kind["NetworkPolicy"]:
        deployment = deployments[policy["metadata"]["name"]]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        peer, ucx, metrics, engine = policy["spec"]["ingress"]
        assert ucx["from"] == peer["from"]  # the data plane: the same daemons as the peer ports
        named = {p["name"]: p["containerPort"] for c in _sidecars(deployment) for p in c["ports"]}
        assert sorted(p["port"] for p in peer["ports"]) == sorted(v for k, v in named.items() if k.startswith("peer-"))
        (source,) = peer["from"]
        assert source["podSelector"]["matchLabels"] == {k: v for k, v in pod_labels.items()
                                                        if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}
        assert sorted(p["port"] for p in metrics["ports"]) == sorted(v for k, v in named.items() if k.startswith("metrics-"))
        monitoring, tester = metrics["from"]
        assert monitoring == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        assert tester["podSelector"]["matchLabels"] == test_pod["metadata"]["labels"]
        assert engine["ports"] == [{"port": 8000, "protocol": "TCP"}] and engine["from"]  # never every source
        ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert not ports & {47200 + g for g in range(8)}  # the notify bus is not reachable from outside
    _, by_kind = _render(VALUES_FILES["decode-only"])  # no helm test: monitoring only
    assert [len(p["spec"]["ingress"][2]["from"]) for p in by_kind["NetworkPolicy"]] == [1]


def test_cert_manager_certificate():
    _, by_kind = _render(VALUES_FILES["cert-manager"])
    (certificate,) = [c for c in by_kind["Certificate"] if c["metadata"]["name"].endswith("-peer")]
    spec = certificate["spec"]
    assert spec["secretName"].endswith("-peer-tls") and spec["dnsNames"] == ["kvxferd-peer"]
    assert spec["uris"][0].startswith("spiffe://cluster.local/ns/") and "client auth" in spec["usages"]
    pod = by_kind["Deployment"][0]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == spec["secretName"]


def test_without_tls_the_daemons_start_only_when_told_it_is_insecure(tmp_path, monkeypatch):
    _, by_kind = _render({"tls": {"enabled": False}, "insecure": True})
    container = _sidecars(by_kind["Deployment"][0])[0]
    config_text = by_kind["ConfigMap"][0]["data"]["kvxferd.yaml"]
    assert refusal(_daemon_config(container, config_text, tmp_path, monkeypatch)) is None
    # What the chart refuses to render (test_values_that_make_pods_that_cannot_work_are_refused): kvxferd would
    # refuse to start on it too.
    refused = config_text.replace("insecure: true", "insecure: false")
    assert refused != config_text
    assert refusal(_daemon_config(container, refused, tmp_path, monkeypatch)) is not None


def test_install_notes_name_the_release_and_what_is_missing():
    text = chart.notes(release="kvx", namespace="serving")
    assert "kvx-kvxferd in namespace serving" in text and "helm test kvx -n serving" in text
    assert "Secret kvx-kvxferd-peer-tls" in text  # TLS without cert-manager: the Secret the user must make
    assert "WARNING" in chart.notes(VALUES_FILES["insecure"])
    assert "Secret" not in chart.notes(VALUES_FILES["cert-manager"])


@pytest.mark.parametrize("native", [True, False])
def test_the_daemons_are_native_sidecars_by_default_or_ordinary_containers(native):
    """Issue #60: by default each daemon is an init container with ``restartPolicy: Always`` (a native
    sidecar, Kubernetes >= 1.29) and a startup probe, so the engine starts after every daemon serves and
    stops before them; ``nativeSidecars: false`` keeps them as ordinary containers beside the engine (older
    clusters). Both layouts validate strictly; their daemons differ in nothing else; the grace period
    covers the engine's stop, then each daemon's drain, one after another."""
    objects, by_kind = _render(None if native else {"nativeSidecars": False})
    for obj in objects:
        _validate(obj)
    for deployment in by_kind["Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        names = [c["name"] for c in pod["containers"]]
        daemons = _sidecars(deployment)
        assert daemons and all("exec" in d["startupProbe"] for d in daemons)
        if native:
            assert [c["name"] for c in pod["initContainers"]] == [d["name"] for d in daemons] and names == ["engine"]
            assert all(d["restartPolicy"] == "Always" for d in daemons)
        else:
            assert "initContainers" not in pod and names == ["engine", *[d["name"] for d in daemons]]
            assert not any("restartPolicy" in d for d in daemons)
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["kvxferd.yaml"])
    for deployment in by_kind["Deployment"]:  # one grace period for the engine's stop, then each daemon's
        grace_s, drain_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], config["drain_timeout_s"]
        daemons = len(_sidecars(deployment))
        assert grace_s >= (60 + daemons * (drain_s + 5) if native else drain_s + 20)
    native_daemons = [_sidecars(d) for d in _render()[1]["Deployment"]]
    plain_daemons = [_sidecars(d) for d in _render({"nativeSidecars": False})[1]["Deployment"]]
    assert [[{k: v for k, v in d.items() if k != "restartPolicy"} for d in pod] for pod in native_daemons] == \
        plain_daemons


def test_otel_tracing_sends_every_daemons_spans_to_the_collector_and_is_off_by_default():
    """Issue #60: ``tracing.otlpEndpoint`` gives each daemon OpenTelemetry's own variables (the daemon turns its
    spans on from them: service/base/spans.py); unset, no daemon gets any (the control)."""
    endpoint = "http://otel-collector.monitoring:4317"
    for values, on in ((None, False), ({"tracing": {"otlpEndpoint": endpoint}}, True)):
        objects, by_kind = _render(values)
        for obj in objects:
            _validate(obj)
        for deployment in by_kind["Deployment"]:
            for daemon in _sidecars(deployment):
                env = {e["name"]: e.get("value") for e in daemon["env"]}
                otel = {k: v for k, v in env.items() if k.startswith("OTEL_")}
                assert otel == ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "kvxferd",
                                 "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=$(POD_NAME)"} if on else {}), otel
                assert list(env).index("POD_NAME") < list(env).index("OTEL_RESOURCE_ATTRIBUTES") if on else True
