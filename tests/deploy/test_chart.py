"""The Helm chart renders to valid Kubernetes objects that would run kvxferd as the docs say.

Rendered with scripts/helmlite.py (helm is not installable here), then every
built-in object is validated against the Kubernetes 1.37 schemas (strict:
unknown fields fail) and the kvxferd containers' arguments and config file
are parsed by kvxferd's own CLI and config schema.
"""

import importlib.util
import pathlib
import sys

import kubernetes_validate
import pytest
import yaml

from kvxferd.cli import build_parser
from kvxferd.service.config import config_from_args
from kvxferd.service.net.exposure import refusal

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/kvxferd"
K8S_VERSION = "1.37.0"

spec = importlib.util.spec_from_file_location("helmlite", ROOT / "scripts/helmlite.py")
helmlite = importlib.util.module_from_spec(spec)
sys.modules["helmlite"] = helmlite
spec.loader.exec_module(helmlite)


def _render(**kwargs):
    objects = helmlite.render_objects(CHART, **kwargs)
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    return objects, by_kind


def _validate(obj):
    if obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
        return  # CRDs: checked by test_pod_monitor_scrapes_every_daemon and test_cert_manager_certificate
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_default_values_render_valid_objects():
    objects, by_kind = _render()
    assert {kind: len(objs) for kind, objs in by_kind.items()} == {
        "ConfigMap": 1, "Deployment": 2, "ResourceClaimTemplate": 2, "Service": 2, "PodMonitor": 2, "NetworkPolicy": 2,
        "ServiceAccount": 1}
    for obj in objects:
        _validate(obj)


def test_the_validator_rejects_a_broken_object():
    _, by_kind = _render()
    deployment = by_kind["Deployment"][0]
    deployment["spec"]["template"]["spec"]["containers"][1]["livenessProbe"]["exec"]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _sidecars(deployment):
    return [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"].startswith("kvxferd-")]


def _config_file(by_kind, tmp_path):
    path = tmp_path / "kvxferd.yaml"
    path.write_text(by_kind["ConfigMap"][0]["data"]["kvxferd.yaml"])
    return path


@pytest.mark.parametrize("values", [None, {"roles": [{"name": "prefill", "enabled": False, "replicas": 1, "tensorParallelSize": 1},
                                                     {"name": "decode", "enabled": True, "replicas": 3, "tensorParallelSize": 4}],
                                          "podMonitor": {"enabled": False, "interval": "15s"}}])
def test_one_daemon_per_gpu_that_kvxferd_itself_accepts(values, tmp_path, monkeypatch):
    objects, by_kind = _render(values=values)
    for obj in objects:
        _validate(obj)
    config_path = _config_file(by_kind, tmp_path)
    roles = [r for r in (values or yaml.safe_load((CHART / "values.yaml").read_text()))["roles"] if r["enabled"]]
    assert len(by_kind["Deployment"]) == len(roles)
    assert ("PodMonitor" in by_kind) == (values is None)
    for deployment, role in zip(by_kind["Deployment"], roles):
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["replicas"] == role["replicas"]
        assert pod["shareProcessNamespace"] is True  # legacy CUDA IPC handles (values.yaml); uids kept apart
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert all({"name": "gpus"} in c["resources"]["claims"] for c in pod["containers"])  # same GPUs for all
        sidecars = _sidecars(deployment)
        assert len(sidecars) == role["tensorParallelSize"]
        ports = [p["containerPort"] for c in pod["containers"] for p in c["ports"]]
        assert len(ports) == len(set(ports))
        for gpu, container in enumerate(sidecars):
            env = {e["name"]: e for e in container["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["KVXFERD_ADVERTISE_HOST"]["value"] == "$(POD_IP)"
            # What the container would run, with Kubernetes' $(VAR) expansion done by hand.
            monkeypatch.setenv("KVXFERD_ADVERTISE_HOST", "10.1.2.3")
            argv = [a.replace("$(POD_NAME)", "decode-7d9f-x2").replace("/etc/kvxferd/kvxferd.yaml", str(config_path))
                    for a in container["args"]]
            config = config_from_args(build_parser().parse_args(argv))
            assert config.peer_address == f"10.1.2.3:{container['ports'][0]['containerPort']}"
            assert config.engine_socket == f"/run/kvxferd/gpu{gpu}.sock" and config.daemon_id == f"decode-7d9f-x2-gpu{gpu}"
            assert config.peer_host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
            assert config.notify_host == "127.0.0.1"  # the engine is in the pod: the bus never leaves it
            assert config.notify_port == 47200 + gpu and config.metrics_port == container["ports"][1]["containerPort"]
            # Mutual TLS by default, so kvxferd accepts the exposed peer port without --insecure.
            assert config.tls and not config.insecure and refusal(config) is None
            assert config.tls_cert == "/etc/kvxferd/tls/tls.crt" and config.peer_allowed_ids
            engine_socket = f"unix:/run/kvxferd/gpu{gpu}.sock"
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                # grpc.health.v1 over the engine socket: kubelet's gRPC probes cannot do mutual TLS.
                command = container[probe]["exec"]["command"]
                assert command[:4] == ["kvxferd", "health", "--target", engine_socket]
                health_args = build_parser().parse_args(command[1:])
                assert health_args.target == engine_socket
            assert container["readinessProbe"]["exec"]["command"][-2:] == ["--service", "kvxfer.v1.PeerService"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/run/kvxferd", "/dev/shm", "/etc/kvxferd", "/etc/kvxferd/tls"} <= mounts
        tls_volume = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert "subPath" not in str(sidecars) and tls_volume["secret"]["secretName"].endswith("-peer-tls")
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        engine_container = next(c for c in pod["containers"] if c["name"] == "engine")
        assert engine_container["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["terminationGracePeriodSeconds"] > yaml.safe_load(config_path.read_text())["drain_timeout_s"]


def test_services_and_claims_match_the_pods():
    _, by_kind = _render()
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in by_kind["Deployment"]}
    for service in by_kind["Service"]:
        deployment = deployments[service["metadata"]["labels"]["app.kubernetes.io/component"]]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod_labels.items()
        named = {p["name"] for c in _sidecars(deployment) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    claims = {t["metadata"]["name"]: t for t in by_kind["ResourceClaimTemplate"]}
    for deployment in by_kind["Deployment"]:
        (claim,) = deployment["spec"]["template"]["spec"]["resourceClaims"]
        request = claims[claim["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]["requests"][0]
        assert request["exactly"]["count"] == len(_sidecars(deployment))


def test_pod_monitor_scrapes_every_daemon():
    _, by_kind = _render()
    for monitor in by_kind["PodMonitor"]:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        deployment = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == monitor["metadata"]["name"])
        assert monitor["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        metrics_ports = {p["name"] for c in _sidecars(deployment) for p in c["ports"] if p["name"].startswith("metrics-")}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == metrics_ports


def test_committed_manifests_are_the_rendered_chart():
    committed = (ROOT / "deploy/kubernetes/kvxferd.yaml").read_text()
    assert committed.split("\n", 1)[1] == helmlite.render_stream(CHART), \
        "deploy/kubernetes/kvxferd.yaml is stale: python scripts/helmlite.py deploy/helm/kvxferd > deploy/kubernetes/kvxferd.yaml"


@pytest.mark.parametrize("template, message", [("{{ .Values.x | sha256sum }}", "sha256sum"),
                                               ("{{ with .Values }}x{{ end }}", "with"),
                                               ("{{ if .Values.x }}", "end")])
def test_helmlite_refuses_what_it_does_not_know(template, message):
    with pytest.raises(helmlite.TemplateError, match=message):
        helmlite.Renderer({}).render_nodes(helmlite.parse(template, {}), {"Values": {"x": 1}}, {})


def test_network_policy_admits_only_peers_and_monitoring():
    _, by_kind = _render()
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
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
        assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
        assert engine["ports"] == [{"port": 8000, "protocol": "TCP"}] and engine["from"]  # never every source
        ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert not ports & {47200 + g for g in range(8)}  # the notify bus is not reachable from outside


def test_cert_manager_certificate():
    _, by_kind = _render(values={"tls": {"certManager": {"enabled": True}}})
    (certificate,) = [c for c in by_kind["Certificate"] if c["metadata"]["name"].endswith("-peer")]
    spec = certificate["spec"]
    assert spec["secretName"].endswith("-peer-tls") and spec["dnsNames"] == ["kvxferd-peer"]
    assert spec["uris"][0].startswith("spiffe://cluster.local/ns/") and "client auth" in spec["usages"]
    pod = by_kind["Deployment"][0]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == spec["secretName"]


@pytest.mark.parametrize("insecure", [False, True])
def test_without_tls_the_daemons_start_only_when_told_it_is_insecure(insecure, tmp_path, monkeypatch):
    _, by_kind = _render(values={"tls": {"enabled": False}, "insecure": insecure})
    config_path = _config_file(by_kind, tmp_path)
    container = _sidecars(by_kind["Deployment"][0])[0]
    monkeypatch.setenv("KVXFERD_ADVERTISE_HOST", "10.1.2.3")
    argv = [a.replace("$(POD_NAME)", "p").replace("/etc/kvxferd/kvxferd.yaml", str(config_path)) for a in container["args"]]
    config = config_from_args(build_parser().parse_args(argv))
    assert (refusal(config) is None) == insecure
