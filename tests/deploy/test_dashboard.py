"""The Grafana dashboard charts every metric the daemon exports, and only those."""

import importlib.util
import json
import pathlib
import re

from kvxferd.service.reference import exported_series

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dashboard_is_current_and_every_query_names_real_series():
    spec = importlib.util.spec_from_file_location("gen_dashboard", ROOT / "scripts/gen_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((ROOT / "deploy/grafana/kvxferd.json").read_text())
    assert committed == module.dashboard(), "deploy/grafana/kvxferd.json is stale: run scripts/gen_dashboard.py"
    exprs = [t["expr"] for p in committed["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bkvxferd_\w+", expr)}
    exported = exported_series()
    series = {name for names in exported.values() for name in names}
    assert used <= series, used - series
    assert [m for m, names in exported.items() if not set(names) & used] == []  # nothing left out
    assert len({p["id"] for p in committed["panels"]}) == len(committed["panels"])
