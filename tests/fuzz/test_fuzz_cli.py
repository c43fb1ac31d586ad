"""The CI slice of tests/fuzz/fuzz_cli.py (issue 31's hold-out fuzz): a fixed seed, one
damaged or hostile input of each of its 19 kinds (the flags of every command, hub ids over a
damaged cache, safetensors headers, HF directories, calibration files, .pt2 archives, VLM and
Whisper directories, graph files, task processors, .npy headers, tokenizer internals, chat
templates, manifests, generation configs) through ``circleops.cli.main`` in forked children
under a time and memory limit; the first as a new ``python -m circleops.cli`` process, as a
user runs it. None may run code, die of a signal, end in a traceback or an exit-1 internal
error, run out of memory or hang. The long run: ``python tests/fuzz/fuzz_cli.py --cases 342``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fuzz_cli  # noqa: E402
from cli_kinds import KINDS  # noqa: E402


def test_every_cli_reader_refuses_damage_cleanly(tmp_path):
    stats = fuzz_cli.fuzz_cli(cases=len(KINDS), seed=31, timeout=240, work=tmp_path / "work",
                              save_dir=tmp_path / "failed", in_process=True, process_every=len(KINDS))
    assert all(stats.cases.get(k) == 1 for k in KINDS), stats.summary()
    assert stats.processes == 1, stats.summary()  # case 0 as a user runs it: a new process
    # most damage is refused; some inputs still run (a hostile value that is valid)
    assert stats.outcomes.get("refused", 0) >= len(KINDS) // 2 and stats.outcomes.get("ok", 0) >= 1, stats.summary()
    assert stats.bad == 0, stats.summary() + "\n" + "\n".join(stats.failures)
