"""Generated reference pages are current, and the docs the README links to exist."""

import pathlib
import re

from kvxferd.service.config import DaemonConfig
from kvxferd.service.reference import PAGES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_pages_are_current():
    for path, render in PAGES.items():
        committed = (ROOT / path).read_text()
        assert committed == render(), f"{path} is stale: run scripts/gen_docs.py and commit the result"


def test_configuration_page_names_every_option():
    page = (ROOT / "docs/configuration.md").read_text()
    for name in DaemonConfig.model_fields:
        assert f"`--{name.replace('_', '-')}`" in page and f"`KVXFERD_{name.upper()}`" in page


def test_readme_and_docs_links_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy/README.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
