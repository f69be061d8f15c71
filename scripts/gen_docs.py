#!/usr/bin/env python3
"""Write the generated reference pages (docs/configuration.md, docs/metrics.md)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxferd.service.reference import PAGES  # noqa: E402

for path, render in PAGES.items():
    (ROOT / path).write_text(render())
    print(f"wrote {path}")
