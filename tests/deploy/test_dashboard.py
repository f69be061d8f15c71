"""The Grafana dashboard charts every metric the daemon exports, and only those."""

import importlib.util
import json
import pathlib
import re

from kvxferd.service.base.metrics import build_labels
from kvxferd.service.reference import exported_series, standard_series

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _committed_exprs() -> list[str]:
    committed = json.loads((ROOT / "deploy/grafana/kvxferd.json").read_text())
    return [t["expr"] for p in committed["panels"] for t in p["targets"]]


def test_dashboard_is_current_and_every_query_names_real_series():
    spec = importlib.util.spec_from_file_location("gen_dashboard", ROOT / "scripts/gen_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((ROOT / "deploy/grafana/kvxferd.json").read_text())
    assert committed == module.dashboard(), "deploy/grafana/kvxferd.json is stale: run scripts/gen_dashboard.py"
    exprs = _committed_exprs()
    used = {name for expr in exprs for name in re.findall(r"\bkvxferd_\w+", expr)}
    exported = exported_series()
    series = {name for names in exported.values() for name in names}
    assert used <= series, used - series
    assert [m for m, names in exported.items() if not set(names) & used] == []  # nothing left out
    assert len({p["id"] for p in committed["panels"]}) == len(committed["panels"])


def test_process_series_are_the_daemons_own():
    """process_* and python_* come from every Python exporter in a pod (vLLM's too): a query of them
    names real series of the daemon's registry and keeps only kvxferd targets (those with build info)."""
    standard = set(standard_series())
    for expr in _committed_exprs():
        names = set(re.findall(r"\b(?:process|python)_\w+", expr))
        assert names <= standard, names - standard
        if names:
            assert "and on (job, instance) kvxferd_build_info" in expr, expr


def test_versions_panel_shows_every_build_label():
    """A label added to kvxferd_build_info shows on the dashboard too."""
    [expr] = [expr for expr in _committed_exprs() if re.search(r"\(kvxferd_build_info\b", expr)]
    grouped = re.search(r"by \(([^)]*)\)", expr).group(1).replace(" ", "").split(",")
    assert sorted(grouped) == sorted(build_labels())
