"""Pattern fusion on hand-written modules no adapter knows: every RMSNorm/RoPE spelling
that computes what the circle op computes is fused bit-exactly; near misses are left,
with the reason."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adapter_fixtures import circle_counts
from circleops.passes.fusion import fuse_patterns

C = 32


class Norm(nn.Module):
    """RMSNorm written several ways; ``style`` picks one."""

    def __init__(self, style: str, eps: float = 1e-5):
        super().__init__()
        self.style, self.eps = style, eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(C))

    def forward(self, x):
        s, eps, w = self.style, self.eps, self.weight
        if s == "pow_weight_after":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        if s == "square_weight_first":
            return w * (x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps))
        if s == "rsqrt_first":
            return torch.rsqrt(eps + x.square().mean(dim=-1, keepdim=True)) * x * w
        if s == "upcast_llama":
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return w * h.to(x.dtype)
        if s == "upcast_gemma":
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return (h * (1.0 + w.float())).to(x.dtype)
        if s == "no_weight":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        # near misses
        if s == "sqrt_div":
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        if s == "mean_not_last":
            return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * w
        if s == "rsqrt_reused":
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return x * r * w + r
        raise ValueError(s)


class Block(nn.Module):
    """A norm inside a small network, so its output is not the graph output."""

    def __init__(self, style: str):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(C, C), Norm(style), nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


FUSED = {  # style -> what the report must say (in fp32 both multiply orders are the same computation)
    "pow_weight_after": "offset=0.0",
    "square_weight_first": "offset=0.0",
    "rsqrt_first": "offset=0.0",
    "upcast_llama": "offset=0.0",
    "upcast_gemma": "offset=1.0",
    "no_weight": "no weight",
}
# fp16 models only in the upcast spellings (HF's): where the multiply happens matters there
FUSED_FP16 = {
    "upcast_llama": "multiply=input_dtype, policy=fp32",
    "upcast_gemma": "offset=1.0, multiply=fp32, policy=fp32",
}
CASES = [(s, torch.float32, d) for s, d in FUSED.items()] + [(s, torch.float16, d) for s, d in FUSED_FP16.items()]
LEFT = {
    "sqrt_div": "rsqrt",
    "mean_not_last": "not only the last",
    "rsqrt_reused": "also feeds",
}


def _export(module, x):
    torch.manual_seed(0)
    return torch.export.export(module.eval(), (x,))


@pytest.mark.parametrize("style,dtype,expected", CASES, ids=[f"{s}-{str(d)[6:]}" for s, d, _ in CASES])
def test_handwritten_rmsnorm_is_fused_bit_exactly(style, dtype, expected):
    torch.manual_seed(0)
    model = Block(style).to(dtype)
    x = torch.randn(2, 5, C, dtype=dtype) * 3
    ep = _export(model, x)
    fused, report = fuse_patterns(ep)
    assert circle_counts(fused) == {"rms_norm": 1}
    assert expected in report.fused[0].detail and report.fused[0].where == "norm (Norm)"
    assert not report.left
    with torch.no_grad():
        assert torch.equal(fused.module()(x), model(x))


@pytest.mark.parametrize("style", list(LEFT))
def test_near_misses_are_left_with_the_reason(style):
    torch.manual_seed(0)
    model = Block(style)
    x = torch.randn(2, 5, C)
    fused, report = fuse_patterns(_export(model, x))
    assert not circle_counts(fused)
    assert len(report.left) == 1 and LEFT[style] in report.left[0].detail
    with torch.no_grad():
        assert torch.equal(fused.module()(x), model(x))


def test_norm_as_the_graph_output_keeps_the_signature_valid():
    torch.manual_seed(0)
    model = Norm("pow_weight_after")
    x = torch.randn(3, C)
    ep = _export(model, x)
    fused, _ = fuse_patterns(ep)
    out = fused.graph_signature.user_outputs[0]
    assert out == fused.graph.output_node().args[0][0].name and out.startswith("rms_norm")
    with torch.no_grad():
        assert torch.equal(fused.module()(x), model(x))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Rotary(nn.Module):
    """Hand-written attention-style q/k rotation; ``layout`` picks the spelling."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.proj = nn.Linear(C, 2 * C)

    def forward(self, x, cos, sin):  # x [B, S, C]; cos, sin [S, D]
        b, s, _ = x.shape
        q, k = self.proj(x).view(b, s, 8, 8).transpose(1, 2).chunk(2, dim=1)  # [B, 4, S, 8] each
        if self.layout == "swapped_order":
            q = _rotate_half(q) * sin + cos * q
            k = sin * _rotate_half(k) + k * cos
        elif self.layout == "bshd":  # [B, S, H, D] with cos broadcast over dim 2: not circle.rope's layout
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            c, s_ = cos[None, :, None], sin[None, :, None]
            q, k = q * c + _rotate_half(q) * s_, k * c + _rotate_half(k) * s_
        else:
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return q.sum(-1) + k.sum(-1) if self.layout != "bshd" else (q.sum(-1) + k.sum(-1)).transpose(1, 2)


@pytest.mark.parametrize("layout,fused_count", [("plain", 2), ("swapped_order", 2), ("bshd", 0)])
def test_handwritten_rope(layout, fused_count):
    torch.manual_seed(0)
    model = Rotary(layout)
    x = torch.randn(2, 6, C)
    ang = torch.arange(6.0)[:, None] * torch.arange(1.0, 5.0)[None] * 0.1
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    ep = torch.export.export(model, (x, cos, sin))
    fused, report = fuse_patterns(ep)
    assert circle_counts(fused).get("rope", 0) == fused_count
    if not fused_count:
        assert len(report.left) == 2 and all("[B, H, S, D]" in e.detail for e in report.left)
    with torch.no_grad():
        assert torch.equal(fused.module()(x, cos, sin), model(x, cos, sin))
