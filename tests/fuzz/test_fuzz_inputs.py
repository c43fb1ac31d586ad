"""The CI slice of tests/fuzz/fuzz_inputs.py (issue 31): a fixed seed, seven mutated inputs of
each kind (WAV, image, .npy, manifest, generation config, tokenizer, chat template, speech
manifest, config, safetensors index, generate/chat flags) through their documented entry
points, each in a forked child under a time and memory limit. None may end in a traceback,
an exit-1 "internal error", a signal, a hang or code run."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz_inputs  # noqa: E402

PER_KIND = 7


def test_input_readers_short_run(tmp_path):
    stats = fuzz_inputs.fuzz_inputs(cases=PER_KIND * len(fuzz_inputs.KINDS), seed=31, timeout=120,
                                    save_dir=tmp_path / "failed", work=tmp_path / "work")
    assert all(stats.cases[k] == PER_KIND for k in fuzz_inputs.KINDS), stats.summary()
    assert stats.processes >= 2, stats.summary()  # some CLI cases as a user runs them: a new process
    # the mutations are mostly refused, some still read (a flip inside samples or a string)
    assert stats.outcomes.get("refused", 0) >= 3 * len(fuzz_inputs.KINDS) and stats.outcomes.get("ok", 0) >= 5, \
        stats.summary()
    assert stats.bad == 0, stats.summary() + "\n" + "\n".join(stats.failures)
