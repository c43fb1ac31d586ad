"""The documentation site builds: ``mkdocs build --strict`` (mkdocs.yml: Material theme,
mkdocstrings API pages from the docstrings) with no warning — a broken link between guides, a
nav entry whose file is missing, an API page naming an object that moved, or a docstring
mkdocstrings cannot render fails it — and every guide of docs/ is in the nav."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _nav_files(nav) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_every_guide_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = set(_nav_files(config["nav"]))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - in_nav == set(), "pages missing from mkdocs.yml's nav"
    assert in_nav - pages == set(), "nav entries without a page"


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    site = tmp_path / "site"
    # the API pages are rendered from the docstrings, the architecture page includes CONTRIBUTING.md
    api = (site / "api" / "convert" / "index.html").read_text()
    assert "circleops.pipeline.convert.convert" in api and "example_args" in api
    assert "Adding a lowering" in (site / "architecture" / "index.html").read_text()
    built = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert {"ops", "converting", "llm", "quantization", "targets", "tools", "benchmarks"} <= built


def _linked_guides(text: str, prefix: str = "") -> set[str]:
    return {m.group(1) for m in re.finditer(r"\]\(" + re.escape(prefix) + r"([a-z0-9-]+\.md)\)", text)}


def test_index_and_readme_list_every_guide():
    # a guide nobody links from the front pages is a guide nobody finds
    guides = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert guides - _linked_guides((ROOT / "docs" / "index.md").read_text()) == set(), "docs/index.md"
    assert guides - _linked_guides((ROOT / "README.md").read_text(), "docs/") == set(), "README.md"
