"""The example plugin, tested as its users would: circleops' op battery on both ops, the
entry point seen by `circleops ops` and by the interpreter of a fresh process, and the
module adapters converting a model for every target."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import circleops
from circleops.tools.inspect import summarize
from circleops.runtime import reference
from circleops.testing import check_op

from circleops_npu_ops import gelu_tanh, sample_gelu_tanh, sample_swiglu, swiglu
from circleops_npu_ops.adapters import SwiGLU, patched_npu_modules


@pytest.mark.parametrize("op, samples", [(swiglu, sample_swiglu), (gelu_tanh, sample_gelu_tanh)],
                         ids=["swiglu", "gelu_tanh"])
def test_the_op_battery(op, samples):
    check_op(op, samples)


def test_circleops_ops_lists_the_plugin_ops(installed):
    # the CLI of this interpreter's environment, in a fresh process: the plugin is found by
    # its entry point, not by an import in this test
    out = subprocess.run([sys.executable, "-m", "circleops.cli", "ops", "--format", "json"], capture_output=True,
                         text=True, check=True)
    rows = {r["op"]: r for r in json.loads(out.stdout)}
    assert rows["npu::swiglu"]["provider"] == "circleops-npu-ops"
    assert rows["npu::swiglu"]["circle builtin"] == "CUSTOM 'NPU_SWIGLU'"
    assert rows["npu::gelu_tanh"]["targets"] == "circle: custom, onert: decomposed, tflite: composite"


class MLP(torch.nn.Module):
    """A gated MLP with the plugin's SwiGLU module and HF's GELUTanh."""

    def __init__(self):
        super().__init__()
        from transformers.activations import GELUTanh

        torch.manual_seed(0)
        self.gate_up = torch.nn.Linear(16, 64)
        self.act = SwiGLU(alpha=1.0)
        self.down = torch.nn.Linear(32, 16)
        self.gelu = GELUTanh()

    def forward(self, x):
        return self.gelu(self.down(self.act(self.gate_up(x))))


X = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
def test_the_adapters_route_a_model_to_the_ops_on_every_target(tmp_path, target):
    model = MLP()
    path = tmp_path / f"mlp.{'tflite' if target == 'tflite' else 'circle'}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", circleops.UnusedPatchWarning)
        with patched_npu_modules():
            report = circleops.convert(model, (X,), path, target=target, verify=True)
    assert report.verify.passed
    summary = summarize(path)
    if target == "circle":
        assert report.ops["CUSTOM"] == 2
        assert {c["custom_code"]: c["options"] for c in summary["custom_ops"]} == {
            "NPU_SWIGLU": {"alpha": 1.0}, "npu::gelu_tanh": {}}
        np.testing.assert_allclose(reference.run(str(path), [X.numpy()])[0], model(X).detach().numpy(),
                                   rtol=1e-6, atol=1e-6)
    elif target == "tflite":
        assert sorted(c["name"] for c in summary["composites"]) == ["npu.gelu_tanh", "npu.swiglu"]
    else:
        assert "CUSTOM" not in report.ops


def test_a_fresh_process_loads_the_plugin_for_a_file_that_needs_it(tmp_path, installed):
    path = tmp_path / "mlp.circle"
    with patched_npu_modules():
        circleops.convert(MLP(), (X,), path, target="circle")
    np.save(tmp_path / "x.npy", X.numpy())
    script = (
        "import sys, numpy as np\n"
        "from circleops.runtime import reference\n"
        "assert 'circleops_npu_ops' not in sys.modules\n"
        f"y = reference.run({str(path)!r}, [np.load({str(tmp_path / 'x.npy')!r})])[0]\n"
        "assert 'circleops_npu_ops' in sys.modules\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, y)\n")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), MLP()(X).detach().numpy(), rtol=1e-6, atol=1e-6)
