"""``x.max(dim)`` / ``x.min(dim)`` (aten.max.dim / min.dim: a (values, indices) pair) and
argmax / argmin with a dim, on every target, against torch."""
from __future__ import annotations

import pytest
import torch

import circleops


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


CASES = {
    "max_dim_pair": lambda x: tuple(x.max(dim=1)),
    "min_dim_keepdim_pair": lambda x: tuple(x.min(dim=-1, keepdim=True)),
    "max_values_only": lambda x: x.max(1).values * 2 + x.min(0).values.sum(),
    "argmax_argmin_dim": lambda x: (x.argmax(dim=1), x.argmin(dim=0, keepdim=True), x.argmax()),
    "amin_amax": lambda x: (x.amin(dim=(0, 2)), torch.amax(x, 1, keepdim=True)),
    "topk_last": lambda x: tuple(torch.topk(x, 3)),
    "topk_dim0_smallest": lambda x: tuple(x.topk(2, dim=0, largest=False)),
    "topk_router": lambda x: x.topk(2, -1).values.softmax(-1) * x.topk(2, -1).indices,
}


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
@pytest.mark.parametrize("name", list(CASES))
def test_max_min_dim(name, target, tmp_path):
    # distinct values: indices of ties would be the runtimes' choice; a generator of the
    # test's own, so the input does not depend on which tests ran before in this worker
    x = torch.randperm(60, generator=torch.Generator().manual_seed(0)).float().reshape(3, 4, 5) / 7
    path = tmp_path / ("m.tflite" if target == "tflite" else "m.circle")
    report = circleops.convert(Fn(CASES[name]), (x,), path, target=target, verify=True)
    # a few float32 ulps of the largest output: sums (the min values' total reaches ~50)
    # and softmax may add in another order than torch
    bound = 1e-6 * max(1.0, report.verify.reference_max_abs)
    assert report.verify.passed and report.verify.max_abs_error <= bound
