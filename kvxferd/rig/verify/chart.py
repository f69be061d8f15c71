"""The Helm chart, rendered and linted by Helm's own engine.

``helm-python-sdk`` carries Helm v4's Go code as a library, so the tests and
the namespace rig render exactly what ``helm template`` / ``helm install``
would, with no helm binary: YAML numbers arrive as float64, ``values.schema.json``
is enforced, and lint runs Helm's own rules. It is a test dependency
(``pip install kvxferd[test]``), never the daemon's: import it only here.
"""

from __future__ import annotations

import functools
import pathlib

import yaml

REPO = pathlib.Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "kvxferd"
#: values files the tests render besides the defaults (chart-testing's ``ci/`` convention)
CI_VALUES = CHART / "ci"
RELEASE, NAMESPACE = "kvxferd", "default"


class ChartUnavailable(RuntimeError):
    """The chart or Helm's engine is not here (an installed package without the source tree)."""


def _helm():
    try:
        import helm_python
    except ImportError as error:
        raise ChartUnavailable("rendering the chart needs helm-python-sdk (pip install 'kvxferd[test]')") from error
    if not (CHART / "Chart.yaml").exists():
        raise ChartUnavailable(f"the chart is rendered from the source tree; {CHART} is missing (run from a checkout)")
    return helm_python


def unavailable() -> str | None:
    """Why the chart cannot be rendered here (None when it can)."""
    try:
        _helm()
    except ChartUnavailable as error:
        return str(error)
    return None


@functools.lru_cache(maxsize=1)
def _chart():
    return _helm().Chart.load(str(CHART))


def render_manifests(values: dict | None = None, *, release: str = RELEASE,
                     namespace: str = NAMESPACE) -> dict[str, str]:
    """Each template's rendered text by its path under the chart (NOTES.txt included), as ``helm template`` renders them.

    ``values`` are merged over values.yaml as ``helm install -f`` does; values
    that break ``values.schema.json`` raise Helm's ``HelmValuesError``."""
    return _chart().render(values or None, name=release, namespace=namespace, is_install=True)


def render_objects(values: dict | None = None, **release) -> list[dict]:
    """Every Kubernetes object the chart renders (tests hooks included), in file order."""
    manifests = render_manifests(values, **release)
    return [obj for path in sorted(manifests) if not path.endswith(".txt")
            for obj in yaml.safe_load_all(manifests[path]) if obj]


def render_stream(values: dict | None = None, **release) -> str:
    """One multi-document YAML stream, ``# Source:`` before each document, as ``helm template --skip-tests``
    prints (plain manifests for ``kubectl apply``: a test hook applied with them would run at once and fail)."""
    manifests = render_manifests(values, **release)
    documents = []
    for path in sorted(manifests):
        if path.endswith(".txt") or "/templates/tests/" in path:
            continue
        for text in manifests[path].split("\n---\n"):
            text = text.strip("\n")
            if text.strip().lstrip("-").strip():
                documents.append(f"---\n# Source: {path}\n{text.removeprefix('---').lstrip(chr(10))}\n")
    return "".join(documents)


def notes(values: dict | None = None, **release) -> str:
    """What ``helm install`` prints after installing (templates/NOTES.txt)."""
    manifests = render_manifests(values, **release)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def lint(values: dict | None = None, *, namespace: str = NAMESPACE, kube_version: str | None = None) -> list[dict]:
    """``helm lint --strict`` findings worse than info: ``[{"severity", "path", "error"}]`` (empty when clean)."""
    report = _helm().lint(str(CHART), values or None, strict=True, namespace=namespace, kube_version=kube_version)
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    return findings + [{"severity": 3, "path": "", "error": e} for e in report["errors"]
                       if not any(e.strip() in m["error"] for m in findings)]


def ci_values() -> dict[str, dict]:
    """The values files under ``ci/`` by name (``default`` is the chart's own values)."""
    files = {"default": {}}
    for path in sorted(CI_VALUES.glob("*-values.yaml")):
        files[path.name.removesuffix("-values.yaml")] = yaml.safe_load(path.read_text()) or {}
    return files
