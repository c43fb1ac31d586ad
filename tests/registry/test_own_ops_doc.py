"""docs/own-ops.md runs as written: its Python blocks, in order, as one script in a fresh
interpreter (the guide is one session), then its shell blocks in the same directory with
this environment's circleops."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "own-ops.md"


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_the_guide_runs_as_written(tmp_path):
    script = tmp_path / "guide.py"
    script.write_text("\n".join(_blocks("python")))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "{'circle': 'custom', 'onert': 'decomposed', 'tflite': 'composite'}" in out
    assert "circle {'CUSTOM': 1, 'FULLY_CONNECTED': 2} reference True" in out
    assert "tflite {'FULLY_CONNECTED': 2, 'STABLEHLO_COMPOSITE(mylib.swiglu)': 1} litert True" in out
    assert re.search(r"onert \{.*'LOGISTIC': 1.*\} onert True", out)
    assert "['schema', 'kernel', 'opcheck', 'gradcheck', 'autocast', 'export', 'targets']" in out
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for command in _blocks("shell"):
        shell = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, env=env)
        assert shell.returncode == 0, (command, shell.stderr[-3000:])
        if "inspect" in command:
            assert "mylib::swiglu x1  custom_options {alpha=0.5}" in shell.stdout
        else:
            assert "circle::rms_norm" in shell.stdout
