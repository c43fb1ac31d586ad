"""docs/benchmarks.md is what bench/report.py makes from bench/results/*.yaml: the page is
generated from the measurements kept as data, never edited by hand."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_is_generated_from_the_results():
    report = _report()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == report.render(), \
        "docs/benchmarks.md differs from bench/results/*.yaml: run python bench/report.py"
    assert report.main(["--check"]) == 0


def test_results_are_tables_of_data():
    """Each results file names its benchmark script, and its tables are rows of cells (a row
    with a missing or extra cell is refused rather than printed askew)."""
    report = _report()
    files = sorted((ROOT / "bench" / "results").glob("*.yaml"))
    assert files
    for path in files:
        data = yaml.safe_load(path.read_text())
        # the script that measured it: one of bench/, or tests/fuzz's runner
        script = re.match(r"(bench|tests)/[\w/]+\.py", data["heading"])
        assert script and (ROOT / script.group(0)).is_file(), path.name
        for block in data["blocks"]:
            if "table" in block:
                report.render_table(block["table"])  # raises on a malformed table
            else:  # a table pasted into prose is not data
                text = block.get("text", "")
                assert not any(ln.startswith("|") for ln in text.splitlines()), f"{path.name}: a table inside text"
    bad = {"columns": ["a", "b"], "align": ["left", "right"], "rows": [["1"]]}
    with pytest.raises(ValueError, match="has 1 cells, not 2"):
        report.render_table(bad)
