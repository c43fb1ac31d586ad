"""circleops.testing.check_op: passes on a good op, fails loudly (naming the op and the
check) on a wrong fake, a kernel that disagrees with the reference, a non-exportable op."""
from __future__ import annotations

import pytest
import torch

import circleops
from circleops.testing import CHECKS, OpCheckError, check_op

SAMPLES = [((torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)),), {"alpha": 0.5}),
           ((torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),), {})]


def _swiglu(x, alpha=1.0):
    a, b = x.chunk(2, -1)
    return torch.nn.functional.silu(a * alpha) * b


good = circleops.op("checks::good(Tensor x, float alpha=1.0) -> Tensor")(_swiglu)


@good.register_fake
def _(x, alpha=1.0):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


wrong_fake = circleops.op("checks::wrong_fake(Tensor x, float alpha=1.0) -> Tensor")(_swiglu)


@wrong_fake.register_fake
def _(x, alpha=1.0):
    return x.new_empty(x.shape)  # forgot that the op halves the last dim


off_kernel = circleops.op("checks::off_kernel(Tensor x, float alpha=1.0) -> Tensor")(_swiglu)


@off_kernel.register_kernel
def _(x, alpha=1.0):
    a, b = x.chunk(2, -1)
    return a * torch.sigmoid(a * alpha) * b  # silu(a·alpha) would be a·alpha·sigmoid(a·alpha)


@circleops.op("checks::data_dependent(Tensor x) -> Tensor")
def data_dependent(x):
    # a branch on the data: no fake can say which way it goes, so torch.export refuses it
    return x * 2 if bool((x > 0).all()) else x


def test_a_good_op_passes_every_check():
    assert check_op(good, SAMPLES) == list(CHECKS)


def test_a_wrong_fake_fails():
    with pytest.raises(OpCheckError, match=r"check_op\(checks::wrong_fake\): check 'opcheck' failed"):
        check_op(wrong_fake, SAMPLES)


def test_a_wrong_fake_fails_the_export_checks_too():
    # without opcheck, the wrong fake's shape reaches the file and the target check catches it
    with pytest.raises(OpCheckError, match=r"checks::wrong_fake\): check '(export|targets)' failed"):
        check_op(wrong_fake, SAMPLES, checks=["export", "targets"])


def test_a_kernel_disagreeing_with_the_reference_fails():
    with pytest.raises(OpCheckError, match=r"check_op\(checks::off_kernel\): check 'kernel' failed \(sample 0, "
                                           r"torch.float32\).*max difference"):
        check_op(off_kernel, SAMPLES)


def test_a_non_exportable_op_fails():
    samples = [((torch.rand(3, 4) + 0.1,), {})]
    with pytest.raises(OpCheckError, match=r"checks::data_dependent\): check 'opcheck' failed"):
        check_op(data_dependent, samples)
    with pytest.raises(OpCheckError, match=r"checks::data_dependent\): check 'export' failed"):
        check_op(data_dependent, samples, checks=["export"])


def test_bad_calls_are_clear():
    with pytest.raises(OpCheckError, match="no samples"):
        check_op(good, [])
    with pytest.raises(OpCheckError, match="unknown checks"):
        check_op(good, SAMPLES, checks=["nope"])
    with pytest.raises(OpCheckError, match="not a registered op"):
        check_op(torch.ops.aten.relu.default, SAMPLES)
    assert check_op(torch.ops.checks.good, SAMPLES, checks=["kernel"]) == ["kernel"]
