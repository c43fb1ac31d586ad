"""circle::instance_norm: aten.instance_norm's NCHW semantics, nn.InstanceNorm2d equality,
fp16/bf16 computed in fp32."""
from __future__ import annotations

import pytest
import torch

from circleops.ops._common import OpArgumentError

instance_norm = torch.ops.circle.instance_norm


def _x(shape=(2, 5, 9, 11), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 4 + torch.randn(shape[1], *[1] * (len(shape) - 2), generator=g) * 10).to(dtype)


@pytest.mark.parametrize("affine", (True, False), ids=("affine", "plain"))
def test_equals_instance_norm_2d(affine):
    module = torch.nn.InstanceNorm2d(5, affine=affine, eps=1e-5)
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(5) + 0.5)
            module.bias.copy_(torch.randn(5))
    x = _x()
    with torch.no_grad():
        want = module(x)
        got = instance_norm(x, module.weight if affine else None, module.bias if affine else None, module.eps)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_equals_aten_instance_norm_any_rank():
    for shape in ((3, 4, 17), (2, 3, 4, 5, 6)):  # 1-d and 3-d spatial
        x = _x(shape)
        w, b = torch.rand(shape[1]) + 0.5, torch.randn(shape[1])
        want = torch.nn.functional.instance_norm(x, weight=w, bias=b, eps=1e-3)
        torch.testing.assert_close(instance_norm(x, w, b, 1e-3), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("float16", "bfloat16"))
def test_low_precision_is_computed_in_fp32(dtype):
    x = _x(dtype=dtype) * 100  # large enough that an fp16 variance (x² ~ 1e5) would overflow
    w, b = (torch.rand(5) + 0.5).to(dtype), torch.randn(5).to(dtype)
    got = instance_norm(x, w, b)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got, instance_norm(x.float(), w.float(), b.float()).to(dtype))


def test_weight_shape_error():
    with pytest.raises(OpArgumentError, match=r"weight must be \[5\], got \[4\]"):
        instance_norm(_x(), torch.ones(4), None)
