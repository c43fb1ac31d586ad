"""circle::rope — rotary position embedding as one op.

x: [B, H, S, D]; cos, sin: [S, R], [B, S, R] or [B, 1, S, R] with R <= D the rotary dims
(the first R channels rotate, the rest pass through, for partial rotary models).
cos/sin are laid out for the mode, as HF builds them:
  * ``"gpt_neox"`` (HF rotate_half): pairs (i, i + R/2); cos = [c, c].
  * ``"gpt_j"`` (interleaved): pairs (2i, 2i + 1); cos = repeat_interleave(c, 2).
out = x·cos + rotate(x)·sin, computed in the order HF computes it (bit-equal in fp32).
"""
from __future__ import annotations

import torch
from torch import Tensor

NAME = "rope"
MODES = ("gpt_neox", "gpt_j")


def _check(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> None:
    torch._check(mode in MODES, lambda: f"circle::rope: mode must be one of {MODES}, got {mode!r}")
    torch._check(x.dim() == 4, lambda: f"circle::rope: x must be [B, H, S, D], got shape {list(x.shape)}")
    torch._check(cos.shape == sin.shape, lambda: f"circle::rope: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    torch._check(cos.dim() in (2, 3, 4), lambda: f"circle::rope: cos must be [S, R], [B, S, R] or [B, 1, S, R], got {list(cos.shape)}")
    r = cos.shape[-1]
    torch._check(r <= x.shape[-1] and r % 2 == 0,
                 lambda: f"circle::rope: rotary dims {r} must be even and <= head dim {x.shape[-1]}")


def _rotate(x: Tensor, mode: str) -> Tensor:
    if mode == "gpt_neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _broadcastable(t: Tensor) -> Tensor:
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t.unsqueeze(1)
    return t


def reference(x: Tensor, cos: Tensor, sin: Tensor, mode: str = "gpt_neox") -> Tensor:
    """The reference kernel (also the decomposition)."""
    _check(x, cos, sin, mode)
    cos, sin = _broadcastable(cos), _broadcastable(sin)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return (x * cos) + (_rotate(x, mode) * sin)
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat(((x_rot * cos) + (_rotate(x_rot, mode) * sin), x_pass), dim=-1)


@torch.library.custom_op("circle::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, mode: str = "gpt_neox") -> Tensor:
    """Rotary embedding of x [B, H, S, D] with cos/sin for its S positions."""
    return reference(x, cos, sin, mode).contiguous()


@rope.register_fake
def _(x, cos, sin, mode="gpt_neox"):
    _check(x, cos, sin, mode)
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    x, cos, sin, mode = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.mode = mode


def _backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x, cos, sin), ctx.needs_input_grad[:3])]
        y = reference(*leaves, ctx.mode)
        wrt = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, grad, allow_unused=True)) if wrt else iter(())
    out = [next(grads) if need else None for need in ctx.needs_input_grad[:3]]
    return (*out, None)


rope.register_autograd(_backward, setup_context=_setup_context)
