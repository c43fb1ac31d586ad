"""circle::attention — a whole self-attention layer with its KV cache, as Circle ATTENTION.

Inputs, in the order of the Circle ATTENTION contract:
  x        [B, S, E]            hidden states of the S new tokens
  wq       [Hq·D, E]            torch Linear layout (out, in); Hq = wq.shape[0] / D
  wk, wv   [Hkv·D, E]           Hkv = k_cache.shape[2]; Hq % Hkv == 0 (GQA, MQA allowed)
  wo       [E, Hq·D]
  cos, sin [S, D] or [B, S, D]  RoPE tables for the S new positions (GPT-NeoX layout)
  mask     [S, C], [B, S, C] or [B, 1, S, C]  additive (0 / -inf or dtype min) over cache slots
  k_cache  [B, C, Hkv, D]       ONE's cache layout (slot-major, not HF's [B, H, S, D])
  v_cache  [B, C, Hkv, D]
  pos      int64 [1]            slot of the first new token
Attribute: scale (0 means 1/sqrt(D)).

Semantics: q, k, v = x·wqᵀ, x·wkᵀ, x·wvᵀ; q and k get RoPE; the new k and v are written at
slots pos .. pos+S-1 of the caches (slots outside that range are copied unchanged; writes
past C are dropped); scores = q·Kᵀ·scale + mask over all C slots; softmax in fp32, cast
back; then ·V and ·woᵀ. Returns (out [B, S, E], k_cache', v_cache'): the cache update is
functional in torch, and in place in an NPU kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from circleops.ops import rope as _rope

NAME = "attention"


def _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos) -> None:
    torch._check(x.dim() == 3, lambda: f"circle::attention: x must be [B, S, E], got {list(x.shape)}")
    torch._check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
                 lambda: f"circle::attention: k_cache and v_cache must both be [B, C, Hkv, D], got {list(k_cache.shape)} and {list(v_cache.shape)}")
    d, hkv = k_cache.shape[3], k_cache.shape[2]
    torch._check(wq.dim() == 2 and wq.shape[0] % d == 0 and wq.shape[1] == x.shape[-1],
                 lambda: f"circle::attention: wq must be [Hq*{d}, {x.shape[-1]}], got {list(wq.shape)}")
    torch._check((wq.shape[0] // d) % hkv == 0,
                 lambda: f"circle::attention: query heads {wq.shape[0] // d} must be a multiple of kv heads {hkv}")
    for name, w in (("wk", wk), ("wv", wv)):
        torch._check(w.dim() == 2 and w.shape[0] == hkv * d and w.shape[1] == x.shape[-1],
                     lambda: f"circle::attention: {name} must be [{hkv * d}, {x.shape[-1]}], got {list(w.shape)}")
    torch._check(wo.dim() == 2 and wo.shape[1] == wq.shape[0],
                 lambda: f"circle::attention: wo must be [E, {wq.shape[0]}], got {list(wo.shape)}")
    torch._check(pos.numel() == 1 and not pos.is_floating_point(),
                 lambda: f"circle::attention: pos must be an integer tensor [1], got {pos.dtype} {list(pos.shape)}")
    torch._check(mask.shape[-1] == k_cache.shape[1],
                 lambda: f"circle::attention: mask's last dim must be the cache size {k_cache.shape[1]}, got {list(mask.shape)}")


def update_cache(cache: Tensor, new: Tensor, pos: Tensor) -> Tensor:
    """Write new [B, S, H, D] into cache [B, C, H, D] at slots pos..pos+S-1, functionally.

    Written as gather + where (no scatter) so that every runtime can run the decomposition.
    """
    s, c = new.shape[1], cache.shape[1]
    rel = torch.arange(c, device=cache.device, dtype=torch.int64) - pos.reshape(-1)[:1].to(torch.int64)
    hit = (rel >= 0) & (rel < s)
    rows = new.index_select(1, rel.clamp(0, s - 1))
    return torch.where(hit[None, :, None, None], rows.to(cache.dtype), cache)


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    # [B, Hkv, C, D] -> [B, Hkv*groups, C, D], each kv head repeated for its query group.
    if groups == 1:
        return t
    b, h, c, d = t.shape
    return t[:, :, None].expand(b, h, groups, c, d).reshape(b, h * groups, c, d)


def reference(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, cos: Tensor, sin: Tensor,
              mask: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
              scale: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The reference kernel (also the decomposition)."""
    _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos)
    b, s, _ = x.shape
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    hq = wq.shape[0] // d
    q = F.linear(x, wq).view(b, s, hq, d).transpose(1, 2)
    k = F.linear(x, wk).view(b, s, hkv, d).transpose(1, 2)
    v = F.linear(x, wv).view(b, s, hkv, d)
    q = _rope.reference(q, cos, sin)
    k = _rope.reference(k, cos, sin)
    k_cache = update_cache(k_cache, k.transpose(1, 2), pos)
    v_cache = update_cache(v_cache, v, pos)
    keys = _expand_kv(k_cache.transpose(1, 2), hq // hkv)
    values = _expand_kv(v_cache.transpose(1, 2), hq // hkv)
    scaling = scale if scale != 0.0 else d ** -0.5
    scores = torch.matmul(q, keys.transpose(2, 3).to(q.dtype)) * scaling
    m = mask if mask.dim() == 4 else (mask[None, None] if mask.dim() == 2 else mask.unsqueeze(1))
    scores = scores + m
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.to(q.dtype)).transpose(1, 2).reshape(b, s, hq * d)
    return F.linear(out, wo), k_cache, v_cache


@torch.library.custom_op("circle::attention", mutates_args=())
def attention(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, cos: Tensor, sin: Tensor,
              mask: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
              scale: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Self-attention with RoPE and a KV cache; see the module docstring for the contract."""
    out, k, v = reference(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, scale)
    return out.contiguous(), k.contiguous(), v.contiguous()


@attention.register_fake
def _(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, scale=0.0):
    _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos)
    out_dtype = torch.promote_types(x.dtype, wo.dtype)
    return (x.new_empty((*x.shape[:2], wo.shape[0]), dtype=out_dtype),
            torch.empty_like(k_cache, memory_format=torch.contiguous_format),
            torch.empty_like(v_cache, memory_format=torch.contiguous_format))


_DIFFERENTIABLE = 10  # every input but pos


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:11])
    ctx.scale = inputs[11]


def _backward(ctx, g_out, g_k, g_v):
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i < _DIFFERENTIABLE and bool(ctx.needs_input_grad[i]))
                  for i, t in enumerate(saved)]
        outs = reference(*leaves, ctx.scale)
        wrt = [t for t in leaves if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, (g_out, g_k, g_v)) if g is not None]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)) if wrt else iter(())
    result = [next(grads) if t.requires_grad else None for t in leaves]
    return (*result, None)


attention.register_autograd(_backward, setup_context=_setup_context)
