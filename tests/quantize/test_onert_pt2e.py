"""uint8 PT2E files in onert 0.1.0: what it runs (bit-exact with the reference interpreter's
integer kernels), and what it lacks (bench/onert_quantized.py measures each op; the
integer pass keeps those ops float for target onert, or refuses)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.errors import RuntimeRunError, TargetError
from circleops.quantize import pt2e
from circleops.runtime import onert, reference
from circleops.serialize import read_model

pytest.importorskip("onert")


def _save(model, x, path, target="onert", weight="uint8", scheme="uint8", exported=None):
    calib = pt2e.calibration_samples((x,), 3)
    converted, ep = pt2e.quantize(model, (x,), pt2e.make_quantizer(scheme, weight=weight), calib, exported=exported)
    circleops.save(ep, path, target=target)
    return converted


def test_conv_net_uint8_runs_in_onert_like_the_reference(tmp_path, convnet_uint8):
    model, x, converted, ep = convnet_uint8  # uint8 per-tensor weights (tests/quantize/conftest.py)
    circleops.save(ep, tmp_path / "net.circle", target="onert")
    sg = read_model(str(tmp_path / "net.circle")).subgraphs[0]
    assert sum(op.opcode == "CONV_2D" for op in sg.operators) == 8
    assert all(sg.tensors[op.inputs[1]].dtype == "UINT8" for op in sg.operators if op.opcode == "CONV_2D")
    (got,) = onert.run(str(tmp_path / "net.circle"), [x.numpy()])
    (ref,) = reference.run(str(tmp_path / "net.circle"), [x.numpy()])
    step = float(sg.tensors[sg.operators[-1].inputs[0]].quant.scale[0])
    assert np.abs(got - ref).max() <= step + 1e-6  # onert's integer kernels = TFLite reference arithmetic
    assert np.abs(got - converted(x).detach().numpy()).max() < 0.05 * max(1.0, float(np.abs(ref).max()))


class Lacking(torch.nn.Module):
    """relu (as its own op), a slice, and a batch matmul: onert has no uint8 kernel for them."""

    def forward(self, x):
        y = torch.relu(x * 2.0)
        return (y[:, :4] @ y[:, :4].transpose(1, 2)) * 1.0


def test_ops_onert_lacks_stay_float_for_target_onert(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(1, 6, 8)
    model = Lacking().eval()
    _save(model, x, tmp_path / "circle.circle", target="circle")
    # onert would fail at run ("StridedSlice: unsupported data type"): refused before it loads the file
    with pytest.raises(RuntimeRunError, match=r"quantized BATCH_MATMUL, STRIDED_SLICE .*--runtime reference"):
        onert.run(str(tmp_path / "circle.circle"), [x.numpy()])
    converted = _save(model, x, tmp_path / "onert.circle")
    sg = read_model(str(tmp_path / "onert.circle")).subgraphs[0]
    floats = {op.opcode for op in sg.operators if sg.tensors[op.outputs[0]].dtype == "FLOAT32"}
    assert {"STRIDED_SLICE", "BATCH_MATMUL"} <= floats and "MUL" not in floats
    (got,) = onert.run(str(tmp_path / "onert.circle"), [x.numpy()])
    assert np.abs(got - converted(x).detach().numpy()).max() < 0.05 * max(1.0, float(np.abs(got).max()))


@pytest.mark.parametrize("scheme,weight,match", [("int16", "uint8", "int16"), ("uint8", "int8", "per-channel")])
def test_onert_refuses_what_it_computes_wrongly(tmp_path, scheme, weight, match):
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval(), torch.randn(1, 8)
    with pytest.raises(TargetError, match=match):
        _save(model, x, tmp_path / "m.circle", scheme=scheme, weight=weight)
    assert not (tmp_path / "m.circle").exists()
