"""Quantized programs shared by the tests of tests/quantize: PT2E calibration, convert_pt2e
and the re-export cost more than the checks, so a model quantized once serves every test
that only writes or runs it differently."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def convnet_uint8():
    """TransformerNet (reflection pads, convs, instance norm, upsampling) with its instance
    norms fused, quantized once: uint8 activations, uint8 per-tensor weights (what onert
    runs; target circle writes them too). (model, x, converted module, ExportedProgram)."""
    from convnet import TransformerNet

    from circleops.passes.fusion import fuse_patterns
    from circleops.quantize import pt2e

    torch.manual_seed(0)
    model, x = TransformerNet(4, 1).eval(), torch.rand(1, 3, 16, 16)
    ep, _ = fuse_patterns(torch.export.export(model, (x,)))  # instance norm as circle.instance_norm
    calib = pt2e.calibration_samples((x,), 3)
    converted, qep = pt2e.quantize(model, (x,), pt2e.make_quantizer("uint8", weight="uint8"), calib, exported=ep)
    return model, x, converted, qep


class _OddLinears(torch.nn.Module):
    """A K=40 linear (not a multiple of GGML's 32-value blocks), a linear with a real bias
    and a ReLU after it, and a K=64 one: what weight formats must handle besides plain FCs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(40, 64, bias=False)
        self.b = torch.nn.Linear(64, 64, bias=True)
        self.c = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


@pytest.fixture
def odd_linears():
    """_OddLinears with seeded weights and a bias in [1, 2) (which onert's GGML FC would refuse)."""
    torch.manual_seed(0)
    model = _OddLinears().eval()
    with torch.no_grad():
        model.b.bias.uniform_(1, 2)
    return model
