"""The CLI prints one paragraph whatever fails inside, and ends quietly on a closed pipe."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from circleops import ir
from circleops.serialize import write_model

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

_RAISE_INSIDE = textwrap.dedent("""
    import sys
    import circleops.cli.inspect as cmd
    def boom(args):
        raise KeyError("an unexpected failure deep inside")
    cmd.main = boom
    from circleops.cli import main
    sys.exit(main(["inspect", "whatever.circle"]))
""")


def test_unexpected_exception_is_one_paragraph_exit_1(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _RAISE_INSIDE], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("circleops: internal error in inspect: KeyError:")
    assert "please report" in lines[0]


def test_corrupt_file_is_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.circle"
    bad.write_bytes(b"\x10\x00\x00\x00CIR0" + b"\xff" * 40)
    for argv in (["inspect", str(bad)], ["run", str(bad)]):
        proc = subprocess.run([sys.executable, "-m", "circleops.cli", *argv], capture_output=True, text=True,
                              env=ENV, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "corrupt" in proc.stderr


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    # `circleops inspect x | head`: head exits before circleops writes.
    n = 4
    sg = ir.Subgraph("main", [ir.Tensor(f"t{i}", (1, n), "FLOAT32") for i in range(301)],
                     [ir.Operator("RELU", [i], [i + 1]) for i in range(300)], [0], [300])
    path = tmp_path / "m.circle"
    write_model(ir.Model([sg]), path)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "inspect", str(path)], stdout=w,
                          stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path, timeout=120)
    os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 141)
    np.testing.assert_equal(proc.returncode, 141)


def test_convert_of_a_plain_exported_sequential_works(tmp_path):
    # Reported: `circleops convert model.pt2` of nn.Sequential(Linear, ReLU) printed a torch
    # traceback. It converts; and whatever fails, the CLI prints no traceback.
    from tests_helpers_pt2 import plain_pt2

    pt2 = plain_pt2(tmp_path / "model.pt2")
    out = tmp_path / "model.circle"
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "convert", str(pt2), "-o", str(out), "--verify",
                           "--quiet"], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and out.exists()
