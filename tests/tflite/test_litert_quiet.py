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
