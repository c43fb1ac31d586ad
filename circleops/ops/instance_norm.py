"""circle::instance_norm — instance normalisation of NCHW input, as aten.instance_norm.

y = (x - mean) / sqrt(var + eps) · weight + bias, mean and (biased) var over each (N, C)
plane. fp16 and bf16 inputs are computed in fp32 and cast back.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

NAME = "instance_norm"


def _check(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> None:
    torch._check(x.dim() >= 3, lambda: f"circle::instance_norm: x must be [N, C, ...], got shape {list(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            torch._check(t.dim() == 1 and t.shape[0] == x.shape[1],
                         lambda: f"circle::instance_norm: {name} must be [{x.shape[1]}], got {list(t.shape)}")


def reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5) -> Tensor:
    """The reference kernel (also the decomposition)."""
    _check(x, weight, bias)
    dims = tuple(range(2, x.dim()))
    h = x.to(torch.float32)
    mean = h.mean(dims, keepdim=True)
    centered = h - mean
    var = (centered * centered).mean(dims, keepdim=True)
    y = centered * torch.rsqrt(var + eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(torch.float32).reshape(shape)
    if bias is not None:
        y = y + bias.to(torch.float32).reshape(shape)
    return y.to(x.dtype)


@torch.library.custom_op("circle::instance_norm", mutates_args=())
def instance_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5) -> Tensor:
    """Instance norm of x [N, C, *spatial] (NCHW), per-channel affine optional."""
    return reference(x, weight, bias, eps).contiguous()


@instance_norm.register_fake
def _(x, weight, bias, eps=1e-5):
    _check(x, weight, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (x, weight, bias)))
    ctx.present = (True, weight is not None, bias is not None)
    ctx.eps = eps


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(need)) if present else None
                  for t, present, need in zip(saved, ctx.present, ctx.needs_input_grad[:3])]
        y = reference(*leaves, ctx.eps)
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, grad, allow_unused=True)) if wrt else iter(())
    out = [next(grads) if (present and need) else None for present, need in zip(ctx.present, ctx.needs_input_grad[:3])]
    return (*out, None)


instance_norm.register_autograd(_backward, setup_context=_setup_context)
