"""The mutation check (issue 25): each mutant of tests/mutation/mutants.py, a realistic bug
in a kernel, a lowering, the writer, a quantizer, the GGML/int8 codecs, the sampler or the
generator, turns its named end-to-end test red.

tests/mutation/run_mutants.py runs each mutant's test once, in a child forked from one
process that imported torch, transformers and circleops (CIRCLEOPS_MUTANT set: the root
tests/conftest.py applies the mutant before the tests import circleops' modules); each test
here asserts pytest reported its mutant's test failed: exit code 1 with "1 failed" (not a
collection error, not a skip). A mutant that survives means its test cannot see the bug it
exists for. The clean tests pass in the suite itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("mutation")  # one worker runs them all, from one run of the runner


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "CIRCLEOPS_MUTANT")}
    env["TMPDIR"] = str(tmp_path_factory.mktemp("mutants"))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mutation" / "run_mutants.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_killed_by_its_end_to_end_test(results, name):
    mutant, got = MUTANTS[name], results[name]
    assert got["exit"] == 1 and "1 failed" in got["tail"], (
        f"mutant {name} ({mutant.what}) survived {mutant.kills} (pytest exit {got['exit']}):\n{got['tail']}")


def test_an_unknown_mutant_is_an_error():
    import mutants

    with pytest.raises(KeyError, match="no such mutant"):
        mutants.apply("no_such_mutant")
