"""The mutation check (issue 25): each mutant of tests/mutation/mutants.py, a realistic bug
in a kernel, a lowering, the writer, a quantizer, the GGML/int8 codecs, the sampler or the
generator, turns its named end-to-end test red.

Each runs that one test in a subprocess with CIRCLEOPS_MUTANT set (tests/conftest.py applies
the mutant before the tests import circleops' modules) and asserts pytest reports it failed:
exit code 1 with "1 failed" (not an error of collection, not a skip). A mutant that survives
means its test cannot see the bug it exists for. The clean test passes in the suite itself.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mutants import MUTANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_killed_by_its_end_to_end_test(name):
    mutant = MUTANTS[name]
    env = {**os.environ, "CIRCLEOPS_MUTANT": name}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", mutant.kills, "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "--no-header", "-W", "ignore"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 1 and "1 failed" in proc.stdout, (
        f"mutant {name} ({mutant.what}) survived {mutant.kills} (exit {proc.returncode}):\n{tail}\n{proc.stderr[-2000:]}")


def test_an_unknown_mutant_is_an_error():
    import mutants

    with pytest.raises(KeyError, match="no such mutant"):
        mutants.apply("no_such_mutant")
