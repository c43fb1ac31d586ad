"""``circleops.convert(..., quantize="uint8"|"int16", calibrate=N)`` and ``circleops convert
--quantize uint8 --calibrate N``: export, calibration, integer file, verify."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import circleops
from circleops.cli import main
from circleops.errors import CircleOpsError
from circleops.serialize import read_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "convert"))
from convert_fixtures import llama_config, llama_model  # noqa: E402,F401


def _dtypes(path):
    sg = read_model(str(path)).subgraphs[0]
    return {(op.opcode, sg.tensors[op.outputs[0]].dtype) for op in sg.operators}


def test_convert_conv_net_uint8_for_onert_verified_in_onert(tmp_path):
    pytest.importorskip("onert")
    from convnet import TransformerNet

    torch.manual_seed(0)
    model, x = TransformerNet(4, 1).eval(), torch.rand(1, 3, 16, 16)
    report = circleops.convert(model, (x,), tmp_path / "net.circle", target="onert", quantize="uint8",
                               calibrate=3, verify=True)
    assert report.verify.runtime == "onert" and report.verify.passed
    ops = _dtypes(tmp_path / "net.circle")
    assert ("CONV_2D", "UINT8") in ops and "calibrate" in report.timings


def test_cli_quantize_int16_llm_from_config(capsys, tmp_path, llama_config):
    out = tmp_path / "m.circle"
    code = main(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8",
                 "--quantize", "int16", "--calibrate", "2", "--verify"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verify:  reference: max abs error" in captured.out and "MISMATCH" not in captured.out
    ops = _dtypes(out)
    assert ("RMS_NORM", "INT16") in ops and ("FULLY_CONNECTED", "INT16") in ops


def test_cli_quantize_uint8_with_int16_llm_preset(capsys, tmp_path, llama_config):
    out = tmp_path / "m.circle"
    code = main(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8",
                 "--quantize", "uint8", "--int16", "llm", "--calibrate", "1", "--verify"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verify:  reference: max abs error" in captured.out and "MISMATCH" not in captured.out
    ops = _dtypes(out)
    # the preset llm: norms, residual adds and the MLPs int16; attention and the lm_head uint8
    assert ("RMS_NORM", "INT16") in ops and ("ADD", "INT16") in ops and ("FULLY_CONNECTED", "INT16") in ops
    assert ("ATTENTION", "UINT8") in ops and ("FULLY_CONNECTED", "UINT8") in ops
    assert ("RMS_NORM", "UINT8") not in ops and ("ADD", "UINT8") not in ops


@pytest.mark.parametrize("kwargs,match", [
    (dict(target="tflite", quantize="uint8", fuse="adapters"), "no integer RMS_NORM"),
    (dict(target="onert", quantize="int16"), "int16"),
    (dict(quantize="uint8", integer_io=True, verify=True), "integer_io"),
    (dict(target="onert", quantize="uint8", int16=["norms"]), "int16 parts"),
    (dict(quantize="int16", int16=["norms"]), "int16 parts"),
    (dict(quantize="uint8", int16=["norms", "no such!"]), "neither a part"),
])
def test_convert_refuses_before_work(tmp_path, kwargs, match):
    model = torch.nn.Linear(4, 4)
    suffix = ".tflite" if kwargs.get("target") == "tflite" else ".circle"
    with pytest.raises(CircleOpsError, match=match):  # TargetError, QuantizeConfigError
        circleops.convert(model, (torch.randn(1, 4),), tmp_path / f"m{suffix}", **kwargs)
    assert not list(tmp_path.iterdir())
