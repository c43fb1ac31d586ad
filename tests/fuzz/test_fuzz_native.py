"""The CI slice of tests/fuzz/fuzz_native.py (issue 24): a fixed seed, a few mutated Circle
and TFLite files through `circleops run --runtime onert|litert` and mutated directories
(manifest.json and graph files) through `circleops generate`, each in a forked child. None
may die of a signal, print a traceback, hang, or crash a runtime on a file the verifier
passed (a crash the one-shot commands contain still counts: the verifier let it through)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz_native  # noqa: E402


def test_native_paths_short_run(tmp_path):
    stats = fuzz_native.fuzz_native(cases=14, seed=2024, timeout=300, save_dir=tmp_path, time_budget=60)
    assert all(stats.cases.get(p, 0) >= 4 for p in fuzz_native.PATHS), stats.summary()
    assert stats.exit0 >= 3 and stats.exit2 >= 6, stats.summary()  # the seeds run, mutations are refused
    assert stats.bad == 0, stats.summary() + "\n" + "\n".join(stats.failures)
