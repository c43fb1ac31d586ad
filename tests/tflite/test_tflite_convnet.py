"""The InstanceNorm conv net (tests/convnet.py) as TFLite: every instance norm one
"circle.instance_norm" composite, run in LiteRT like torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import convnet
from tflite_util import RESOLVERS, composite_counts, composites, litert, max_error, read, scale


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_convnet_runs_in_litert_like_torch(converted, resolver):
    c = converted("convnet")
    (got,) = litert(c.path, c.inputs, resolver)
    (want,) = c.expected
    assert got.shape == want.shape == (1, 3, 32, 32)
    assert max_error(got, want) <= 1e-4 * scale(want)


def test_one_composite_per_instance_norm(converted):
    c = converted("convnet")
    net = convnet.build()
    ep = torch.export.export(net, (convnet.example_image(),))
    in_graph = sum(1 for n in ep.graph.nodes if n.op == "call_function" and "instance_norm" in str(n.target))
    modules = [m for m in net.modules() if isinstance(m, torch.nn.InstanceNorm2d)]
    assert in_graph == len(modules) == 9
    m = read(c.path)
    assert composite_counts(m) == {"circle.instance_norm": 9}
    for comp, module in zip(composites(m), modules):
        assert comp.attributes == {"epsilon": pytest.approx(module.eps)}
        main = m.subgraphs[0]
        # x, weight, bias: the affine parameters go in as constants
        assert len(comp.op.inputs) == 3
        assert list(main.tensors[comp.op.inputs[0]].shape)[:2] == [1, module.num_features]
