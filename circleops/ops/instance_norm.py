"""circle::instance_norm — instance normalisation of NCHW input, as aten.instance_norm.

y = (x - mean) / sqrt(var + eps) · weight + bias, mean and (biased) var over each (N, C)
plane (any number of spatial dims). fp16 and bf16 inputs are computed in fp32 (weight and
bias too) and cast back: the output dtype is x.dtype. fp64 is computed in fp64.

Under ``torch.autocast`` the op computes in fp32 (inputs cast to fp32, fp32 out), as for
circle::rms_norm.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from circleops.ops._common import at_least_fp32, check

NAME = "instance_norm"


def _check(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> None:
    check(x.dim() >= 3, lambda: f"circle::instance_norm: x must be [N, C, ...], got shape {list(x.shape)}")
    check(x.is_floating_point(), lambda: f"circle::instance_norm: x must be a floating tensor, got {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check(t.dim() == 1 and t.shape[0] == x.shape[1],
                  lambda: f"circle::instance_norm: {name} must be [{x.shape[1]}], got {list(t.shape)}")


def reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """The reference kernel (also the decomposition)."""
    _check(x, weight, bias)
    dims = tuple(range(2, x.dim()))
    dtype = at_least_fp32(x.dtype)
    h = x.to(dtype)
    mean = h.mean(dims, keepdim=True)
    centered = h - mean
    var = (centered * centered).mean(dims, keepdim=True)
    y = centered * torch.rsqrt(var + eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(dtype).reshape(shape)
    if bias is not None:
        y = y + bias.to(dtype).reshape(shape)
    return y.to(x.dtype)


def fake(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """The output's shape and dtype (torch.export, FakeTensor)."""
    _check(x, weight, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def sample_inputs(dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """(args, kwargs): affine and not, weight only, 1-d and 3-d spatial, fp32 affine with low-precision x."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 4, 5, generator=g) * 2 + 1).to(dtype)
    w = (torch.rand(3, generator=g) + 0.5).to(dtype)
    b = torch.randn(3, generator=g).to(dtype)
    samples = [
        ((x, w, b), {}),
        ((x, None, None), {"eps": 1e-3}),
        ((x, w, None), {}),
        ((x[:, :, 0], w, b), {}),  # [N, C, L]
        ((x[..., None].expand(2, 3, 4, 5, 2), w, b), {}),  # [N, C, D, H, W], non-contiguous
    ]
    if dtype != torch.float32 and dtype != torch.float64:
        samples.append(((x, w.float(), b.float()), {}))
    return samples
