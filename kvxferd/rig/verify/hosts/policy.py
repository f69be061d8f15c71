"""The chart's NetworkPolicy, enforced as packet-filter rules inside the fabric's hosts.

Each host plays a pod: it carries the labels of the role it runs
(``app.kubernetes.io/component: prefill`` ...) in the release's namespace.
The NetworkPolicy objects the chart renders are read as Kubernetes reads
them: a policy whose ``podSelector`` matches a host's labels makes that
host's ingress default-deny, and each ingress rule admits its ports from
the hosts its ``from`` peers select. The result is written with iptables
in the host's namespace (the NFQUEUE fault rules need the legacy backend)::

    INPUT ─► KVX-FAULT (linkfaults.py, first when it is there: loss, delay, partition)
          ─► KVX-POLICY: lo ─ ACCEPT
                         ESTABLISHED,RELATED ─ ACCEPT  (NetworkPolicy is stateful)
                         tcp from <admitted host> to <admitted ports> ─ ACCEPT   (one per rule, per source)
                         anything else ─ DROP (its counter: packets the policy refused)

Egress is not restricted: the chart's policies are ``policyTypes: [Ingress]``.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress

import yaml

from kvxferd.rig.verify import chart
from kvxferd.rig.verify.chart import NAMESPACE, RELEASE
from kvxferd.rig.verify.hosts import fabric as fabric_rig
from kvxferd.rig.verify.hosts.fabric import IPTABLES, Fabric, Host

POLICY_CHAIN = "KVX-POLICY"
MAX_HOSTS = 8  # the most hosts `--hosts N` of the demo and the soak take (the fabric holds more)


@dataclasses.dataclass(frozen=True)
class Admitted:
    """TCP ports ``low..high`` admitted from ``source`` (an address) into one host."""

    source: str
    low: int
    high: int


class HostsUnavailable(RuntimeError):
    """Namespace hosts cannot run here (not root, no netns, no iptables, no Helm engine): the reason."""


def unavailable() -> str | None:
    """Why namespace hosts with the chart's policy cannot run here (None when they can)."""
    return fabric_rig.unavailable() or chart.unavailable()


def require() -> None:
    """Raise :class:`HostsUnavailable` with the reason when namespace hosts cannot run here (``--hosts``)."""
    reason = unavailable()
    if reason:
        raise HostsUnavailable(f"--hosts cannot run here: {reason}")


def chart_values() -> dict:
    """The chart's default values (ports, roles)."""
    return yaml.safe_load((chart.CHART / "values.yaml").read_text())


@functools.lru_cache(maxsize=1)
def release_config() -> dict:
    """The daemons' configuration file as the chart renders it with its defaults (allow-list, UCX range)."""
    (config_map,) = [o for o in chart.render_objects() if o["kind"] == "ConfigMap"]
    return yaml.safe_load(config_map["data"]["kvxferd.yaml"])


def render_policies(tp_by_role: dict[str, int]) -> list[dict]:
    """The NetworkPolicy objects the chart renders with ``tp_by_role`` GPUs per pod of each role (only these roles).

    Needs the source tree and Helm's engine (``kvxferd.rig.verify.chart``), as the demo and the tests have them."""
    defaults = chart_values()["roles"]
    roles = {name: {"enabled": name in tp_by_role, "replicas": 1, "tensorParallelSize": tp_by_role.get(name, 1)}
             for name in {*defaults, *tp_by_role}}
    objects = chart.render_objects({"roles": roles, "tests": {"enabled": False}})
    return [o for o in objects if o.get("kind") == "NetworkPolicy"]


def pod_labels(role: str | None) -> dict[str, str]:
    """The labels a host running ``role`` carries (None: a pod of no kvxferd release, an outsider)."""
    if role is None:
        return {"app.kubernetes.io/name": "other"}
    return {"app.kubernetes.io/name": "kvxferd", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": role}


def _selects(selector: dict, labels: dict) -> bool:
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"selector {selector} uses more than matchLabels; the rig does not read it")
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, labels: dict, address: str) -> bool:
    """Whether one ``from`` entry selects a host (its pods are in the release's namespace)."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        inside = ipaddress.ip_address(address) in ipaddress.ip_network(block["cidr"])
        return inside and not any(ipaddress.ip_address(address) in ipaddress.ip_network(e)
                                  for e in block.get("except", ()))
    namespace_ok = ("namespaceSelector" not in peer
                    or _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": NAMESPACE}))
    pods_ok = "podSelector" not in peer or _selects(peer["podSelector"], labels)
    return namespace_ok and pods_ok


def admitted(policies: list[dict], host_labels: dict[str, dict], addresses: dict[str, str],
             target: str) -> list[Admitted] | None:
    """What ``target``'s ingress admits from the other hosts (by name), or None when no policy selects it."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], host_labels[target])]
    if not selecting:
        return None
    found: list[Admitted] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", ()):
            sources = [name for name in addresses if name != target and
                       ("from" not in rule or any(_peer_admits(peer, host_labels[name], addresses[name])
                                                 for peer in rule["from"]))]
            for port in rule.get("ports") or [{"port": 1, "endPort": 65535}]:
                if port.get("protocol", "TCP") != "TCP":
                    continue
                low = int(port["port"])
                found += [Admitted(addresses[name], low, int(port.get("endPort", low))) for name in sources]
    return found


def install(fabric: Fabric, host: Host, rules: list[Admitted] | None) -> None:
    """``host``'s policy chain, when a policy selects it (else it admits everything, as an unselected pod)."""
    def iptables(*argv: str) -> None:
        fabric.run(host, IPTABLES, "-w", *argv)

    if rules is None:
        return
    iptables("-N", POLICY_CHAIN)
    iptables("-A", "INPUT", "-j", POLICY_CHAIN)
    iptables("-A", POLICY_CHAIN, "-i", "lo", "-j", "ACCEPT")
    iptables("-A", POLICY_CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    for rule in rules:
        iptables("-A", POLICY_CHAIN, "-p", "tcp", "-s", rule.source, "--dport", f"{rule.low}:{rule.high}",
                 "-j", "ACCEPT")
    iptables("-A", POLICY_CHAIN, "-j", "DROP")


def refused_packets(fabric: Fabric, host: Host) -> int:
    """Packets ``host``'s policy dropped so far (the counter of its last rule)."""
    listed = fabric.run(host, IPTABLES, "-w", "-L", POLICY_CHAIN, "-n", "-v", "-x", check=False)
    lines = [line.split() for line in listed.stdout.splitlines() if " DROP " in f" {line} "]
    return int(lines[-1][0]) if lines else 0


def enforce(fabric: Fabric, roles: dict[str, str | None], tp_by_role: dict[str, int]) -> dict[str, list[Admitted] | None]:
    """Render the chart's policies for these TP sizes and install them on every host (``roles``: host name ->
    the role it runs, None for an outsider); what each host admits."""
    policies = render_policies(tp_by_role)
    labels = {name: pod_labels(role) for name, role in roles.items()}
    addresses = {host.name: host.address for host in fabric.hosts}
    installed = {}
    for host in fabric.hosts:
        installed[host.name] = admitted(policies, labels, addresses, host.name)
        install(fabric, host, installed[host.name])
    return installed
