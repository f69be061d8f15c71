#!/usr/bin/env python3
"""Write deploy/kubernetes/kvxferd.yaml: the chart rendered by Helm's engine with its default values.

Release ``kvxferd`` in namespace ``default``, as ``helm template kvxferd deploy/helm/kvxferd``
would print it. Needs the test extras (helm-python-sdk): `.venv/bin/python scripts/render_chart.py`.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvxferd.rig.verify import chart  # noqa: E402

HEADER = "# Rendered by scripts/render_chart.py (Helm's engine) from deploy/helm/kvxferd; edit the chart, not this file.\n"

if __name__ == "__main__":
    path = chart.REPO / "deploy/kubernetes/kvxferd.yaml"
    path.write_text(HEADER + chart.render_stream())
    print(f"wrote {path.relative_to(chart.REPO)}")
