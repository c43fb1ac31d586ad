"""The conv net (tests/convnet.py) in onert: NHWC convolutions between transposes, reflect
padding and nearest upsampling as exact gathers, instance norm decomposed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import convnet
from circleops.lowering import lower_program
from circleops.runtime import onert
from circleops.serialize import write_model
from lowering_util import opcodes


@pytest.fixture(scope="module")
def net_and_program():
    net, x = convnet.build(), convnet.example_image()
    return net, x, torch.export.export(net, (x,), strict=False)


def test_convnet_runs_in_onert(net_and_program, tmp_path):
    net, x, ep = net_and_program
    model = lower_program(ep, "onert")
    ops = opcodes(model)
    assert ops["CONV_2D"] == 10
    assert not {"MIRROR_PAD", "RESIZE_NEAREST_NEIGHBOR", "INSTANCE_NORM"} & set(ops), ops
    path = tmp_path / "convnet.circle"
    write_model(model, path, "circle")
    (got,) = onert.run(path, [x.numpy()])
    with torch.no_grad():
        want = net(x).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
