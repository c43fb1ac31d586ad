"""circle::rms_norm — RMSNorm as one op, reproducing every Hugging Face variant bit for bit.

y = x / sqrt(mean(x², -1) + eps) · (weight + offset)

``multiply`` says where the weight multiply happens relative to the cast back to the
input dtype, which is exactly where the HF families differ:
  * ``"input_dtype"`` (Llama, Mistral, Qwen2/3, Phi3): normalize in fp32, cast to the
    input dtype, then ``weight * y`` (type promotion with the weight dtype applies).
  * ``"fp32"`` (OLMo2, Gemma 1/2/3 with offset=1): ``(weight * y)`` in fp32, then cast.

``policy`` says how the normalisation is computed:
  * ``"fp32"``: upcast, compute, cast back (what HF does). The default.
  * ``"scaled"``: compute in the input dtype on x/max|x| with eps/max|x|², so that
    fp16-only hardware never overflows x².
  * ``"native"``: compute in the input dtype, reproducing what a backend that drops the
    cast computes (and where it overflows).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

NAME = "rms_norm"
POLICIES = ("fp32", "scaled", "native")
MULTIPLY = ("input_dtype", "fp32")


def _check(x: Tensor, weight: Optional[Tensor], policy: str, multiply: str) -> None:
    torch._check(policy in POLICIES, lambda: f"circle::rms_norm: policy must be one of {POLICIES}, got {policy!r}")
    torch._check(multiply in MULTIPLY, lambda: f"circle::rms_norm: multiply must be one of {MULTIPLY}, got {multiply!r}")
    torch._check(x.dim() >= 1, lambda: "circle::rms_norm: x must have at least one dimension")
    if weight is not None:
        torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                     lambda: f"circle::rms_norm: weight must be [{x.shape[-1]}] to match x's last dim, got {list(weight.shape)}")


def _normalize(x: Tensor, eps: float, policy: str) -> Tensor:
    """The normalisation alone; returns fp32 for policy fp32, else the input dtype."""
    if policy == "fp32":
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(variance + eps)
    if policy == "native":
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + eps)
    # scaled: m = max|x| clamped away from 0 (the smallest normal of the dtype), then
    # (x/m) · rsqrt(mean((x/m)²) + eps/m²). eps is rescaled so the result equals the
    # unscaled formula; dropping that rescale makes tiny inputs drift.
    tiny = torch.finfo(x.dtype).tiny
    m = x.abs().amax(-1, keepdim=True).clamp_min(tiny)
    xs = x / m
    eps_s = (eps / m.to(torch.float32).pow(2)).clamp(max=torch.finfo(x.dtype).max).to(x.dtype)
    variance = xs.pow(2).mean(-1, keepdim=True)
    return xs * torch.rsqrt(variance + eps_s)


def reference(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, offset: float = 0.0,
              multiply: str = "input_dtype", policy: str = "fp32") -> Tensor:
    """The reference kernel: plain aten ops, so it is also the decomposition."""
    _check(x, weight, policy, multiply)
    input_dtype = x.dtype
    h = _normalize(x, eps, policy)
    if weight is None:
        return h.to(input_dtype)
    w = weight
    if multiply == "fp32":
        w = w.to(torch.float32)
        if offset != 0.0:
            w = offset + w
        return (h.to(torch.float32) * w).to(input_dtype) if policy == "fp32" else (h * w.to(input_dtype))
    if offset != 0.0:
        w = offset + w
    return w * h.to(input_dtype)


def _out_dtype(x: Tensor, weight: Optional[Tensor], multiply: str) -> torch.dtype:
    if weight is None or multiply == "fp32":
        return x.dtype
    return torch.promote_types(weight.dtype, x.dtype)


@torch.library.custom_op("circle::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, offset: float = 0.0,
             multiply: str = "input_dtype", policy: str = "fp32") -> Tensor:
    """RMSNorm over the last dim; see the module docstring for the attributes."""
    return reference(x, weight, eps, offset, multiply, policy).contiguous()


@rms_norm.register_fake
def _(x, weight, eps=1e-6, offset=0.0, multiply="input_dtype", policy="fp32"):
    _check(x, weight, policy, multiply)
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, multiply))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, multiply, policy = inputs
    ctx.save_for_backward(x, weight)
    ctx.attrs = (eps, offset, multiply, policy)


def _backward(ctx, grad):
    # Differentiate the reference kernel itself, so the gradient is that of exactly the
    # computation the forward ran (all variants and policies included).
    x, weight = ctx.saved_tensors
    with torch.enable_grad():
        xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
        wd = weight.detach().requires_grad_(ctx.needs_input_grad[1]) if weight is not None else None
        y = reference(xd, wd, *ctx.attrs)
        wrt = [t for t in (xd, wd) if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, grad, allow_unused=True)) if wrt else iter(())
    gx = next(grads) if ctx.needs_input_grad[0] else None
    gw = next(grads) if weight is not None and ctx.needs_input_grad[1] else None
    return gx, gw, None, None, None, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)
