"""circle::rope — rotary position embedding as one op.

x: [B, H, S, D]; cos, sin: [S, R], [B, S, R] or [B, 1, S, R] with R <= D the rotary dims
(the first R channels rotate, the rest pass through, for partial rotary models).
cos/sin are laid out for the mode, as HF builds them:
  * ``"gpt_neox"`` (HF rotate_half): pairs (i, i + R/2); cos = [c, c].
  * ``"gpt_j"`` (interleaved): pairs (2i, 2i + 1); cos = repeat_interleave(c, 2).
out = x·cos + rotate(x)·sin, computed in the order HF computes it (bit-equal to HF's
apply_rotary_pos_emb in every dtype). The output dtype is promote(x.dtype, cos.dtype), as
HF's elementwise code gives.

Autocast: none registered. RoPE is elementwise (no matmul), so like HF's rotate_half code
it runs in whatever dtypes it is given under ``torch.autocast``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from circleops.ops._common import check

NAME = "rope"
MODES = ("gpt_neox", "gpt_j")


def _check(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> None:
    check(mode in MODES, lambda: f"circle::rope: mode must be one of {MODES}, got {mode!r}")
    check(x.dim() == 4, lambda: f"circle::rope: x must be [B, H, S, D], got shape {list(x.shape)}")
    check(cos.shape == sin.shape, lambda: f"circle::rope: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    check(cos.dim() in (2, 3, 4), lambda: f"circle::rope: cos must be [S, R], [B, S, R] or [B, 1, S, R], got {list(cos.shape)}")
    r = cos.shape[-1]
    check(r <= x.shape[-1] and r % 2 == 0,
          lambda: f"circle::rope: rotary dims {r} must be even and <= head dim {x.shape[-1]}")


def _rotate(x: Tensor, mode: str) -> Tensor:
    if mode == "gpt_neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def broadcastable(t: Tensor) -> Tensor:
    """cos/sin [S, D], [B, S, D] or [B, 1, S, D] as [B|1, 1, S, D] (circle::rope's layouts)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t.unsqueeze(1)
    return t


def reference(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> Tensor:
    """The reference kernel (also the decomposition)."""
    _check(x, cos, sin, mode)
    cos, sin = broadcastable(cos), broadcastable(sin)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return (x * cos) + (_rotate(x, mode) * sin)
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat(((x_rot * cos) + (_rotate(x_rot, mode) * sin), x_pass), dim=-1)


def fake(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> Tensor:
    """The output's shape and dtype (torch.export, FakeTensor)."""
    _check(x, cos, sin, mode)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype))


def sample_inputs(dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """(args, kwargs) covering both modes, partial rotary and the cos/sin layouts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g).to(dtype)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * (10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    neox = torch.cat((angles, angles), -1)
    gptj = angles.repeat_interleave(2, -1)
    cos, sin = neox.cos().to(dtype), neox.sin().to(dtype)
    samples = [
        ((x, cos, sin), {}),
        ((x, gptj.cos().to(dtype), gptj.sin().to(dtype)), {"mode": "gpt_j"}),
        ((x, cos[None].expand(2, 5, 8), sin[None].expand(2, 5, 8)), {}),  # [B, S, R]
        ((x, cos[None, None], sin[None, None]), {}),  # [B, 1, S, R]
        ((x, cos[:, :2].repeat(1, 2), sin[:, :2].repeat(1, 2)), {}),  # partial rotary, R = 4 < D = 8
    ]
    if dtype != torch.float32 and dtype != torch.float64:
        samples.append(((x, cos.float(), sin.float()), {}))  # fp32 tables, low-precision x
    return samples
