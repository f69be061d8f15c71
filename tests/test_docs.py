"""Generated reference pages are current, and the docs the README links to exist."""

import pathlib
import re

from kvxferd.service.base.config import DaemonConfig
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


def test_layouts_page_names_every_layout_and_dtype():
    from kvxferd.layout.specs import ATTENTION_LAYOUTS
    from kvxferd.layout.strided import ITEMSIZES

    page = (ROOT / "docs/layouts.md").read_text()
    for name in (*ATTENTION_LAYOUTS, *ITEMSIZES):
        assert f"`{name}`" in page, f"docs/layouts.md does not describe {name}"


def test_protocol_page_shows_the_compatibility_facts_as_the_code_writes_them():
    from kvxferd.layout.specs import AttentionSpec, MambaSpec
    from kvxferd.plan.groups import CacheGroup, EngineCache, RegionMemory
    from kvxferd.wire.peerinfo import model_facts

    groups = (CacheGroup("full", AttentionSpec("packed_HND", 4, 8, 128, 16), 32),
              CacheGroup("mamba", MambaSpec(4, 64, 64, 8, 128, 4), 8))
    memory = tuple((RegionMemory(0, 1 << 40),) * g.num_regions for g in groups)
    facts = model_facts(EngineCache("e", 1, 0, groups, memory))
    assert facts in (ROOT / "docs/protocol.md").read_text(), facts
