"""Issue 35, "chart identity pinned to the release": the Helm chart trusts this release only.

Each test fails on the chart before the issue: its allow-list trusted
``ns/*``, it had no ServiceAccount, referenced a ClusterIssuer, ran the
engine as the daemons' user in a shared process namespace, admitted every
source on the engine port and left UCX's ports unpinned.
"""

import pytest
import yaml

from kvxferd.cli import build_parser
from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base.config import config_from_args
from kvxferd.service.base.localsock import credentials_allowed, group_id
from kvxferd.service.peers.tls import check_own_certificate, identity_matches
from kvxferd.rig.verify.certs import DevCA
from tests.deploy.test_chart import CHART, _render, _sidecars, _validate

RELEASE, NAMESPACE = "kvx", "serving"
IDENTITY = f"spiffe://cluster.local/ns/{NAMESPACE}/sa/kvx-kvxferd"


def _release(values=None):
    objects, by_kind = _render(values=values, release=RELEASE, namespace=NAMESPACE)
    for obj in objects:
        _validate(obj)
    return by_kind


def _daemon_config(by_kind, tmp_path, monkeypatch):
    """The configuration a kvxferd container of the first Deployment would run with."""
    path = tmp_path / "kvxferd.yaml"
    path.write_text(by_kind["ConfigMap"][0]["data"]["kvxferd.yaml"])
    monkeypatch.setenv("KVXFERD_ADVERTISE_HOST", "10.1.2.3")
    container = _sidecars(by_kind["Deployment"][0])[0]
    argv = [a.replace("$(POD_NAME)", "p").replace("/etc/kvxferd/kvxferd.yaml", str(path)) for a in container["args"]]
    return config_from_args(build_parser().parse_args(argv))


def _pods(by_kind):
    return [d["spec"]["template"]["spec"] for d in by_kind["Deployment"]]


def _engine(pod):
    return next(c for c in pod["containers"] if c["name"] == "engine")


def _daemons(pod):
    return [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"].startswith("kvxferd-")]


def test_default_allow_list_names_only_this_release(tmp_path, monkeypatch):
    by_kind = _release()
    config = _daemon_config(by_kind, tmp_path, monkeypatch)
    assert config.peer_allowed_ids == [IDENTITY]  # this namespace and this release's ServiceAccount
    assert not any("*" in p or "?" in p for p in config.peer_allowed_ids)
    for other in ("spiffe://cluster.local/ns/other/sa/kvx-kvxferd",   # the same release name elsewhere
                  "spiffe://cluster.local/ns/other/sa/kvxferd",       # what the old default admitted
                  f"spiffe://cluster.local/ns/{NAMESPACE}/sa/other-kvxferd"):  # another release here
        assert not any(identity_matches(f"uri:{other}", p) for p in config.peer_allowed_ids), other
    # Only the URI SAN is the identity (issue #53): a DNS SAN or common name spelling it is not.
    assert any(identity_matches(f"uri:{IDENTITY}", p) for p in config.peer_allowed_ids)
    assert not any(identity_matches(f"{kind}:{IDENTITY}", p) for p in config.peer_allowed_ids for kind in ("dns", "cn"))
    (account,) = by_kind["ServiceAccount"]
    assert IDENTITY.endswith("/sa/" + account["metadata"]["name"])


def test_allow_list_and_identity_can_be_overridden(tmp_path, monkeypatch):
    allowed = ["spiffe://example.org/ns/serving/sa/kvx-kvxferd", "uri:spiffe://example.org/ns/serving/sa/legacy"]
    by_kind = _release({"tls": {"allowedIds": allowed, "trustDomain": "example.org", "certManager": {"enabled": True}}})
    assert _daemon_config(by_kind, tmp_path, monkeypatch).peer_allowed_ids == allowed
    peer = next(c for c in by_kind["Certificate"] if c["metadata"]["name"].endswith("-peer"))
    assert peer["spec"]["uris"] == ["spiffe://example.org/ns/serving/sa/kvx-kvxferd"]


def test_the_release_certificate_is_on_its_allow_list_and_nobody_else_is(tmp_path, monkeypatch):
    """A daemon refuses to start on its own certificate when none of its identities is allowed
    (exit 3): the Certificate the chart asks cert-manager for must pass the chart's own allow-list."""
    by_kind = _release({"tls": {"certManager": {"enabled": True}}})
    config = _daemon_config(by_kind, tmp_path, monkeypatch)
    spec = next(c for c in by_kind["Certificate"] if c["metadata"]["name"].endswith("-peer"))["spec"]
    assert spec["uris"] == [IDENTITY] and spec["dnsNames"] == [config.peer_server_name]
    ca = DevCA(tmp_path / "ca")
    ours = ca.issue("ours", dns_names=tuple(spec["dnsNames"]), spiffe_id=spec["uris"][0])
    check_own_certificate(ours.cert.read_bytes(), config.peer_server_name, tuple(config.peer_allowed_ids))
    theirs = ca.issue("theirs", dns_names=tuple(spec["dnsNames"]), spiffe_id="spiffe://cluster.local/ns/other/sa/kvxferd")
    with pytest.raises(InvalidArgumentError, match="peer_allowed_ids"):
        check_own_certificate(theirs.cert.read_bytes(), config.peer_server_name, tuple(config.peer_allowed_ids))


def test_the_chart_creates_the_service_account_the_pods_use():
    by_kind = _release()
    (account,) = by_kind["ServiceAccount"]
    assert account["metadata"]["name"] == "kvx-kvxferd" and account["automountServiceAccountToken"] is False
    for pod in _pods(by_kind):
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
    by_kind = _release({"serviceAccount": {"create": False, "name": "serving-kv"}})
    assert "ServiceAccount" not in by_kind
    assert {pod["serviceAccountName"] for pod in _pods(by_kind)} == {"serving-kv"}
    assert yaml.safe_load(by_kind["ConfigMap"][0]["data"]["kvxferd.yaml"])["peer_allowed_ids"] == [
        f"spiffe://cluster.local/ns/{NAMESPACE}/sa/serving-kv"]


def test_cert_manager_uses_a_namespaced_issuer_of_this_release_by_default():
    by_kind = _release({"tls": {"certManager": {"enabled": True}}})
    assert "ClusterIssuer" not in yaml.safe_dump(by_kind["Certificate"])
    issuers = {i["metadata"]["name"]: i for i in by_kind["Issuer"]}
    certificates = {c["metadata"]["name"]: c for c in by_kind["Certificate"]}
    peer_ref = certificates["kvx-kvxferd-peer"]["spec"]["issuerRef"]
    assert peer_ref == {"name": "kvx-kvxferd-ca", "kind": "Issuer", "group": "cert-manager.io"}
    ca_issuer = issuers[peer_ref["name"]]
    assert "namespace" not in ca_issuer["metadata"]  # in the release's namespace
    ca = next(c for c in certificates.values() if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"])
    assert ca["spec"]["isCA"] is True
    root_ref = ca["spec"]["issuerRef"]
    assert root_ref["kind"] == "Issuer" and issuers[root_ref["name"]]["spec"] == {"selfSigned": {}}


@pytest.mark.parametrize("kind", ["ClusterIssuer", "Issuer"])
def test_cert_manager_can_use_an_existing_issuer(kind):
    ref = {"name": "corp-ca", "kind": kind, "group": "cert-manager.io"}
    by_kind = _release({"tls": {"certManager": {"enabled": True, "issuerRef": ref}}})
    (certificate,) = by_kind["Certificate"]  # no CA of its own
    assert certificate["spec"]["issuerRef"] == ref and "Issuer" not in by_kind


def test_the_engine_container_cannot_read_the_tls_key():
    by_kind = _release()
    for pod in _pods(by_kind):
        engine = _engine(pod)
        # Shared for legacy CUDA IPC handles (vLLM's default GPU cache); another uid still cannot reach a
        # daemon's /proc/<pid>/root (ptrace rules), which is what keeps the key from the engine.
        assert pod["shareProcessNamespace"] is True
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert {m["name"] for m in engine["volumeMounts"]} == {"sockets", "shm"}  # no tls, no config
        tls_users = [c["name"] for c in pod.get("initContainers", []) + pod["containers"]
                     if any(m["name"] == "tls" for m in c["volumeMounts"])]
        assert tls_users == [c["name"] for c in _daemons(pod)]
        engine_user = engine["securityContext"]["runAsUser"]
        # The engine client talks only to sockets of the daemons' uid (SO_PEERCRED, socket owner).
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert {str(c["securityContext"]["runAsUser"]) for c in _daemons(pod)} == {env["KVXFERD_DAEMON_UID"]}
        for sidecar in _daemons(pod):
            context = sidecar["securityContext"]
            assert context["runAsUser"] != engine_user and min(context["runAsUser"], engine_user) > 0
            assert context["runAsGroup"] != engine["securityContext"]["runAsGroup"]
    apart = _release({"shareProcessNamespace": False})  # host-memory or VMM caches need no shared namespace
    assert all("shareProcessNamespace" not in pod for pod in _pods(apart))


def test_the_daemons_admit_the_engine_user_on_their_sockets(tmp_path, monkeypatch):
    """Every socket admits the engine's uid by an ACL entry (allowed_uids), and the fd and reads sockets check it
    with SO_PEERCRED; no group is shared with the sockets, since the pod's fsGroup is every container's
    (issue 53: tests/security/test_socket_files.py runs it). The engine mounts them read-only."""
    by_kind = _release()
    config = _daemon_config(by_kind, tmp_path, monkeypatch)
    pod = _pods(by_kind)[0]
    engine = _engine(pod)["securityContext"]
    group = group_id(config.engine_socket_group)
    assert group is None
    (mount,) = [m for m in _engine(pod)["volumeMounts"] if m["name"] == "sockets"]
    assert mount["readOnly"] is True
    allowed = frozenset(config.allowed_uids)
    assert allowed == {engine["runAsUser"]}
    assert credentials_allowed(engine["runAsUser"], engine["runAsGroup"], allowed, group)
    assert not credentials_allowed(engine["runAsUser"] + 1, engine["runAsGroup"] + 1, allowed, group)


def test_the_engine_port_admits_only_the_proxy():
    by_kind = _release()
    for policy in by_kind["NetworkPolicy"]:
        (engine_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 8000, "protocol": "TCP"}]]
        assert engine_rule["from"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "proxy"}}}]
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    by_kind = _release({"networkPolicy": {"engineFrom": gateway}})
    for policy in by_kind["NetworkPolicy"]:
        assert policy["spec"]["ingress"][-1]["from"] == gateway


def test_ucx_runs_on_a_pinned_range_that_only_this_release_may_reach(tmp_path, monkeypatch):
    by_kind = _release()
    config = _daemon_config(by_kind, tmp_path, monkeypatch)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    low, high = values["ports"]["ucx"]["min"], values["ports"]["ucx"]["max"]
    assert config.ucx_tcp_port_range == f"{low}-{high}"
    for policy, deployment in zip(by_kind["NetworkPolicy"], by_kind["Deployment"]):
        (rule,) = [r for r in policy["spec"]["ingress"] if any("endPort" in p for p in r["ports"])]
        assert rule["ports"] == [{"port": low, "endPort": high, "protocol": "TCP"}]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvxferd",
                                                                 "app.kubernetes.io/instance": RELEASE}}}]
        daemons = len(_sidecars(deployment))
        assert high - low + 1 >= 2 * daemons  # two listening ports per daemon were seen (values.yaml)
        pod = deployment["spec"]["template"]["spec"]
        other_ports = {p["containerPort"] for c in pod.get("initContainers", []) + pod["containers"] for p in c["ports"]}
        other_ports |= {values["ports"]["notify"] + g for g in range(daemons)}
        assert not any(low <= port <= high for port in other_ports)
    # OS-picked ports only without the policy (with it the chart refuses: UCX would be dropped).
    unpinned = _release({"ports": {"ucx": None}, "networkPolicy": {"enabled": False}})
    assert "ucx_tcp_port_range" not in unpinned["ConfigMap"][0]["data"]["kvxferd.yaml"]
    assert "NetworkPolicy" not in unpinned
