"""The CI slice of the fuzz harness (tests/fuzz/fuzz.py): a fixed seed, a few hundred
mutated Circle/TFLite files through the readers, inspect, the reference interpreter and
the CLI; every one must end in success or a CircleOpsError, none may hang."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz  # noqa: E402

CASES = 120


def test_short_fuzz_run_has_no_uncaught_errors_and_no_hangs(tmp_path):
    # a fixed number of cases, not a time budget: the same files on every machine, however busy
    stats = fuzz.fuzz(cases=CASES, seed=1234, timeout=20, save_dir=tmp_path, cli_every=8)
    assert stats.cases == CASES, stats.summary()
    assert stats.read_ok >= 6 and stats.ran_ok >= 4, stats.summary()  # the unmutated seeds read and run
    assert stats.uncaught == 0 and stats.hangs == 0 and stats.bad_exit == 0, \
        stats.summary() + "\n" + "\n".join(stats.failures)
