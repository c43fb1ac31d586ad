"""LiteRT's "INFO: Created TensorFlow Lite XNNPACK delegate for CPU." line (C++, on fd 2)
never reaches the terminal, where it used to land inside `circleops generate`'s streamed text;
whatever else LiteRT writes there still does."""
from __future__ import annotations

import os

import numpy as np
import torch

import circleops
from circleops.runtime import litert


def _tflite(tmp_path):
    path = tmp_path / "add.tflite"
    ep = torch.export.export(torch.nn.Linear(4, 3), (torch.randn(1, 4),))
    circleops.save(ep, str(path), target="tflite")
    return path


def test_delegate_banner_hidden(tmp_path, capfd):
    path = _tflite(tmp_path)
    capfd.readouterr()
    out = litert.run(path, [np.ones((1, 4), np.float32)])
    assert out[0].shape == (1, 3)
    captured = capfd.readouterr()
    assert litert.DELEGATE_BANNER not in captured.err + captured.out


def test_other_fd2_output_passes_through(capfd):
    with litert.delegate_banner_hidden():
        os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\nsomething else\n")
    err = capfd.readouterr().err
    assert err == "something else\n"


def test_generate_on_litert_ends_without_litert_teardown_lines(tmp_path):
    """`circleops generate` on LiteRT: stderr holds the timing line and nothing LiteRT logs.
    Each CompiledModel had an Environment of its own, whose teardown logged three "INFO: [...]
    DestroyAccelerator" lines when the in-place cache arrays (holding its TensorBuffers) went
    at the end of the command; one Environment kept for the process goes silently at exit."""
    import subprocess
    import sys

    from circleops.recipes.llm import convert_graphs
    from families import BY_NAME

    out = tmp_path / "gen"
    convert_graphs(BY_NAME["llama"].build(), out, target="tflite", prefill_len=(8,), max_cache_len=32)
    done = subprocess.run([sys.executable, "-m", "circleops.cli", "generate", str(out), "--token-ids", "5,6,7",
                           "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "no tokens streamed"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("circleops generate [litert]"), done.stderr
