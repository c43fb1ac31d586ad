"""verify compares non-finite outputs as torch has them: a NaN where torch has NaN and torch's
own infinities match, and an infinity in torch's output does not make the tolerance infinite."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import circleops
from circleops.pipeline.convert import compare_file
from circleops.errors import VerifyError


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x), torch.softmax(x.masked_fill(x > 0, float("-inf")), -1)


X = torch.tensor([[0.0, -1.0, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]])  # log: -inf, nan; row 1 of the softmax: all -inf


def test_nan_and_inf_where_torch_has_them_pass(tmp_path):
    report = circleops.convert(Log(), (X,), tmp_path / "m.circle", target="circle", verify=True)
    assert report.verify.passed and math.isfinite(report.verify.max_abs_error)
    assert report.verify.max_abs_error <= 1e-6
    assert report.verify.reference_max_abs == pytest.approx(math.log(4.0), rel=1e-6)  # finite outputs only


def test_an_infinity_does_not_widen_the_tolerance(tmp_path):
    path = tmp_path / "m.circle"
    circleops.convert(Log(), (X,), path, target="circle", verify=False)
    expected = [t.clone() for t in Log()(X)]
    expected[0][0, 2] += 1.0  # torch disagrees with the file at one finite value
    result = compare_file(path, "reference", [X], expected, torch.float32)
    assert not result.passed and result.max_abs_error == pytest.approx(1.0, rel=1e-6)
    expected[0][0, 2] -= 1.0
    expected[0][0, 1] = 0.0  # the file's NaN where torch has a number
    result = compare_file(path, "reference", [X], expected, torch.float32)
    assert not result.passed and np.isnan(result.max_abs_error)
