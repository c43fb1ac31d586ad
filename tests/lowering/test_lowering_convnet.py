"""The conv net (tests/convnet.py) for targets circle and tflite: NHWC builtins with the
layout transposes cancelled, INSTANCE_NORM for circle, composites for tflite."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import convnet
from circleops.lowering import lower_program
from circleops.runtime import reference
from circleops.serialize import write_model
from lowering_util import opcodes


@pytest.fixture(scope="module")
def net():
    net, x = convnet.build(), convnet.example_image()
    ep = torch.export.export(net, (x,), strict=False)
    with torch.no_grad():
        want = net(x).numpy()
    return ep, x, want


def test_circle_convnet_is_channels_last_end_to_end(net):
    ep, x, want = net
    model = lower_program(ep, "circle")
    ops = opcodes(model)
    assert ops["CONV_2D"] == 10 and ops["INSTANCE_NORM"] == 9 and ops["MIRROR_PAD"] == 10
    assert ops["RESIZE_NEAREST_NEIGHBOR"] == 2
    assert ops["TRANSPOSE"] == 2  # NCHW -> NHWC at the input, back at the output
    sg = model.subgraphs[0]
    conv = next(op for op in sg.operators if op.opcode == "CONV_2D")
    w = sg.tensors[conv.inputs[1]]
    assert w.is_const and w.shape == (8, 9, 9, 3)  # OHWI, pre-transposed at conversion time
    (got,) = reference.run(model, [x.numpy()])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_tflite_convnet_runs_in_litert(net, tmp_path):
    from circleops.runtime import litert

    ep, x, want = net
    model = lower_program(ep, "tflite")
    composites = [op for op in model.subgraphs[0].operators if op.opcode == "STABLEHLO_COMPOSITE"]
    assert len(composites) == 9 and {op.options["name"] for op in composites} == {"circle.instance_norm"}
    path = tmp_path / "convnet.tflite"
    write_model(model, path, "tflite")
    (got,) = litert.run(path, [x.numpy()])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_padding_modes_and_upsampling_are_exact_without_the_builtins():
    """Target onert has no MIRROR_PAD / RESIZE_NEAREST_NEIGHBOR: constant-index gathers."""

    class Pads(torch.nn.Module):
        def forward(self, x):
            a = torch.nn.functional.pad(x, (2, 1, 1, 2), mode="reflect")
            b = torch.nn.functional.pad(x, (1, 2, 2, 1), mode="replicate")
            c = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="circular")
            d = torch.nn.functional.interpolate(x, scale_factor=3, mode="nearest")
            e = torch.nn.functional.interpolate(x, size=(7, 5), mode="nearest")
            return a, b, c, d, e

    x = torch.randn(1, 2, 5, 4)
    ep = torch.export.export(Pads(), (x,), strict=False)
    for target in ("onert", "circle"):
        model = lower_program(ep, target)
        assert ("MIRROR_PAD" in opcodes(model)) == (target == "circle")
        got = reference.run(model, [x.numpy()])
        for g, w in zip(got, Pads()(x)):
            np.testing.assert_array_equal(g, w.numpy())
