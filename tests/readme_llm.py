"""The LLM guide's first command (docs/llm.md, the README's main job), run once per test
process: `circleops convert smollm2 --graphs prefill,decode --target onert --verify -o out/`.

Both tests/docs/test_readme.py (the guide's commands on out/, in page order) and
tests/generate/test_smollm2.py (out/'s tokens against transformers') read the directory this
one run writes, instead of converting the real model twice (~25 s of CPU each). Both put
their tests in the xdist group ``readme_smollm2`` so that one worker converts it once.
The command runs in a fresh process, as a user runs it.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERT = "circleops convert smollm2 --graphs prefill,decode --target onert --verify -o out/"
GROUP = "readme_smollm2"


@dataclass(frozen=True)
class ReadmeOut:
    cwd: Path  # the directory the command ran in: out/ is below it
    proc: subprocess.CompletedProcess

    @property
    def directory(self) -> Path:
        return self.cwd / "out"


def convert(cwd: Path) -> ReadmeOut:
    """Run CONVERT in ``cwd`` (tests/conftest.py's session fixture ``readme_llm_out``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    argv = [sys.executable, "-m", "circleops.cli", *shlex.split(CONVERT)[1:]]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    return ReadmeOut(cwd, proc)
