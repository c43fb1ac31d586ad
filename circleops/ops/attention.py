"""circle::attention — a whole self-attention layer with its KV cache, as Circle ATTENTION.

Inputs, in the order of the Circle ATTENTION contract:
  x        [B, S, E]            hidden states of the S new tokens
  wq       [Hq·D, E]            torch Linear layout (out, in); Hq = wq.shape[0] / D
  wk, wv   [Hkv·D, E]           Hkv = k_cache.shape[2]; Hq % Hkv == 0 (GQA and MQA allowed)
  wo       [E, Hq·D]
  cos, sin [S, D] or [B, S, D]  RoPE tables for the S new positions (GPT-NeoX layout)
  mask     [S, C], [B, S, C] or [B, 1, S, C]  additive (0, or -inf / dtype min) over cache slots
  k_cache  [B, C, Hkv, D]       ONE's cache layout (slot-major, not HF's [B, H, S, D])
  v_cache  [B, C, Hkv, D]
  pos      int64 or int32 [1]   slot of the first new token, 0 <= pos < C
Attributes: scale (0 means 1/sqrt(D)); cache_update ("full" or "rows", below).

Semantics, step by step (the reference kernel below is exactly this):
  1. compute dtype T = promote(x, wq, wk, wv, wo); cos and sin are cast to T.
  2. q = x·wqᵀ, k = x·wkᵀ, v = x·wvᵀ, split into heads of D.
  3. q and k get GPT-NeoX RoPE with cos/sin (circle::rope).
  4. KV-cache update: the new k and v (RoPE'd k, plain v), cast to the cache dtype, are
     written at slots pos .. pos+S-1; every other slot is copied unchanged; writes that
     would land at slot >= C are dropped. The update happens BEFORE attending, so the new
     tokens attend to themselves (the mask decides which slots are visible; a causal
     prefill at pos 0 uses mask[i, j] = 0 for j <= i, else -inf, over all C slots).
  5. scores = q·Kᵀ·scale + mask over all C slots of the updated cache, each kv head shared
     by Hq/Hkv query heads; softmax in fp32 (fp64 for fp64 input), cast back to T (HF
     eager attention's order).
  6. out = (probs·V)·woᵀ, heads concatenated in order.
Returns (out [B, S, E] in T, k_cache' [B, C, Hkv, D], v_cache' [B, C, Hkv, D] in the cache
dtypes). In torch the update is functional (the inputs are not modified); an NPU kernel,
ONE's included, writes the same values into k_cache/v_cache in place and returns only out.
A decode step after a prefill of P tokens is pos = P, S = 1, mask[0, j] = 0 for j <= P.

cache_update = "rows" (llama.cpp's in-place form; what target onert's generation graphs use):
the input caches are only read, and the 2nd/3rd outputs are the S new rows, k_new and v_new
[B, S, Hkv, D] (the RoPE'd k and the v, in the cache dtypes); the caller writes them into its
caches at slots pos.. itself, so a decode step reads the caches once and writes nothing of
them (the "full" form reads and writes every slot of every cache per step). Attention is
over the C input slots the mask leaves visible, plus the S new tokens causally (new token i
sees new tokens j <= i), one softmax over both. The mask must hide the slots >= pos (they
are stale: not written yet in the input); a decode step's is mask[0, j] = 0 for j < pos.
A mask of C + S columns masks the new tokens too: its last S columns replace the causal
order among them (a prefix-LM such as PaliGemma's: the image and prompt tokens see each
other both ways, circleops.adapters.decode.DecoderWithCache's ``prefix_len``).
Without stale slots visible, both forms give the same result (up to the summation order).

Autocast: like linear and scaled_dot_product_attention, the op follows the active autocast
dtype: every floating input (caches included) is cast to it, so the outputs are in it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from circleops.ops import rope as _rope
from circleops.ops._common import at_least_fp32, check
from circleops.options import CACHE_UPDATES

NAME = "attention"


def _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, cache_update) -> None:
    check(cache_update in CACHE_UPDATES,
          lambda: f"circle::attention: cache_update must be one of {CACHE_UPDATES}, got {cache_update!r}")
    check(x.dim() == 3, lambda: f"circle::attention: x must be [B, S, E], got {list(x.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          lambda: f"circle::attention: k_cache and v_cache must both be [B, C, Hkv, D], got {list(k_cache.shape)} and {list(v_cache.shape)}")
    d, hkv = k_cache.shape[3], k_cache.shape[2]
    check(wq.dim() == 2 and wq.shape[0] % d == 0 and wq.shape[1] == x.shape[-1],
          lambda: f"circle::attention: wq must be [Hq*{d}, {x.shape[-1]}], got {list(wq.shape)}")
    check((wq.shape[0] // d) % hkv == 0,
          lambda: f"circle::attention: query heads {wq.shape[0] // d} must be a multiple of kv heads {hkv}")
    for name, w in (("wk", wk), ("wv", wv)):
        check(w.dim() == 2 and w.shape[0] == hkv * d and w.shape[1] == x.shape[-1],
              lambda: f"circle::attention: {name} must be [{hkv * d}, {x.shape[-1]}], got {list(w.shape)}")
    check(wo.dim() == 2 and wo.shape[1] == wq.shape[0],
          lambda: f"circle::attention: wo must be [E, {wq.shape[0]}], got {list(wo.shape)}")
    check(pos.numel() == 1 and not pos.is_floating_point(),
          lambda: f"circle::attention: pos must be an integer tensor [1], got {pos.dtype} {list(pos.shape)}")
    c, s = k_cache.shape[1], x.shape[1]
    check(mask.shape[-1] == c or (cache_update == "rows" and mask.shape[-1] == c + s),
          lambda: f"circle::attention: mask's last dim must be the cache size {c} (or, with cache_update='rows', "
                  f"{c} + {s}: the new tokens masked too), got {list(mask.shape)}")


def update_cache(cache: Tensor, new: Tensor, pos: Tensor) -> Tensor:
    """Write new [B, S, H, D] into cache [B, C, H, D] at slots pos..pos+S-1, functionally.

    Written as gather + where (no scatter) so that every runtime can run the decomposition.
    """
    s, c = new.shape[1], cache.shape[1]
    if s == 1:
        # a decode step: the one new row, broadcast, where the slot is pos (no gather, no
        # index arithmetic: one compare and one select of the cache)
        hit = torch.arange(c, device=cache.device, dtype=torch.int64) == pos.reshape(-1)[:1].to(torch.int64)
        return torch.where(hit[None, :, None, None], new.to(cache.dtype), cache)
    rel = torch.arange(c, device=cache.device, dtype=torch.int64) - pos.reshape(-1)[:1].to(torch.int64)
    hit = (rel >= 0) & (rel < s)
    rows = new.index_select(1, rel.clamp(0, s - 1))
    return torch.where(hit[None, :, None, None], rows.to(cache.dtype), cache)


def compute_dtype(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor) -> torch.dtype:
    """T: the dtype the projections and attention run in."""
    dtype = x.dtype
    for w in (wq, wk, wv, wo):
        dtype = torch.promote_types(dtype, w.dtype)
    return dtype


def reference(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, cos: Tensor, sin: Tensor,
              mask: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, cache_update: str,
              *, rope: Callable[..., Tensor] = _rope.reference,
              rope_qk: Callable[..., tuple[Tensor, Tensor, float]] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The reference kernel (also the decomposition).

    ``rope(x, cos, sin, mode)`` rotates q and k (GPT-NeoX layout, the ATTENTION contract's): the rope reference kernel, or (when a lowering
    traces this kernel) ``torch.ops.circle.rope``, so that the rotation is lowered as the
    rope op is on that target (onert: the ROPE builtin in a decode step).
    ``rope_qk(q, k, cos, sin, scaling) -> (q', k', scaling')``, when given, rotates q and k in
    one step instead (a lowering's form with fewer ops: circleops.lowering.attention_rope); q'
    may carry part of the scores' scaling, the scores then take ``scaling'``: q'·kᵀ·scaling' must
    equal rope(q)·rope(k)ᵀ·scaling exactly.
    """
    _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, cache_update)
    dtype = compute_dtype(x, wq, wk, wv, wo)
    x, wq, wk, wv, wo, cos, sin = (t.to(dtype) for t in (x, wq, wk, wv, wo, cos, sin))
    b, s, _ = x.shape
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    hq = wq.shape[0] // d
    q = F.linear(x, wq).view(b, s, hq, d).transpose(1, 2)
    k = F.linear(x, wk).view(b, s, hkv, d).transpose(1, 2)
    v = F.linear(x, wv).view(b, s, hkv, d)
    scaling = scale if scale != 0.0 else d ** -0.5
    if rope_qk is not None:
        q, k, scaling = rope_qk(q, k, cos, sin, scaling)
    else:
        q = rope(q, cos, sin, "gpt_neox")
        k = rope(k, cos, sin, "gpt_neox")
    m = mask if mask.dim() == 4 else (mask[None, None] if mask.dim() == 2 else mask.unsqueeze(1))
    if cache_update == "rows":
        k_new, v_new = k.transpose(1, 2).to(k_cache.dtype), v.to(v_cache.dtype)
        out = attend_rows(q, k_cache, v_cache, k_new, v_new, m, scaling, dtype)
        return F.linear(out.transpose(1, 2).reshape(b, s, hq * d), wo), k_new, v_new
    k_cache = update_cache(k_cache, k.transpose(1, 2), pos)
    v_cache = update_cache(v_cache, v, pos)
    out = attend_cache(q, k_cache, v_cache, m, scaling, dtype)
    return F.linear(out.transpose(1, 2).reshape(b, s, hq * d), wo), k_cache, v_cache


def _scaled(scores: Tensor, scaling: float) -> Tensor:
    # a scaling of 1 (folded into q by a rope_qk) writes no multiply: x·1 is x exactly
    return scores if scaling == 1.0 else scores * scaling


def _capped(scores: Tensor, softcap: float | None) -> Tensor:
    # HF's attention logit soft-capping (Gemma 2): softcap · tanh(scores / softcap), before the mask
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def attend_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scaling: float, dtype: torch.dtype,
                 softcap: float | None = None) -> Tensor:
    """The "full" form's attention [B, Hq, S, D]: q [B, Hq, S, D] (RoPE'd) over the C slots of
    the updated caches [B, C, Hkv, D], ``mask`` [.., S, C] additive; scores · scaling, then
    (``softcap``) soft-capped, then the mask; softmax in fp32 (fp64 for fp64), cast to ``dtype``.
    Also what adapters/_cached_attention.py runs for the layers circle.attention cannot express."""
    b, hq, s, d = q.shape
    hkv = k_cache.shape[2]
    # GQA without repeating the cache: the G = Hq/Hkv query heads that share kv head h
    # (heads h·G .. h·G+G-1) are G·S rows of one product with that head's C keys, so each
    # key and value is read once, in one BATCH_MATMUL per layer, not copied G times.
    c, g = k_cache.shape[1], hq // hkv
    keys = k_cache.transpose(1, 2).to(dtype)  # [B, Hkv, C, D]
    values = v_cache.transpose(1, 2).to(dtype)
    scores = _scaled(torch.matmul(q.reshape(b, hkv, g * s, d), keys.transpose(2, 3)).view(b, hq, s, c), scaling)
    scores = _capped(scores, softcap) + mask
    probs = torch.softmax(scores, dim=-1, dtype=at_least_fp32(dtype)).to(dtype)
    return torch.matmul(probs.reshape(b, hkv, g * s, c), values).view(b, hq, s, d)


def attend_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, mask: Tensor,
                scaling: float, dtype: torch.dtype, softcap: float | None = None,
                own_mask: Tensor | None = None) -> Tensor:
    """The "rows" form's attention [B, Hq, S, D]: q [B, Hq, S, D] over the C input cache
    slots (``mask`` [.., S, C] hides the stale ones) and the S new keys/values [B, S, Hkv, D]
    (causal among themselves, as ``own_mask`` [.., S, S] says: a sliding window, or as the last
    S columns of a [.., S, C + S] ``mask`` say: a prefix-LM's prefix); one softmax over the C + S
    scores, concatenated. ``softcap`` as in :func:`attend_cache`."""
    b, hq, s, d = q.shape
    c, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * s, d)
    cached = _capped(_scaled(torch.matmul(qg, k_cache.transpose(1, 2).to(dtype).transpose(2, 3)).view(b, hq, s, c),
                             scaling), softcap) + (mask if mask.shape[-1] == c else mask[..., :c])
    # the new keys through the cache dtype and back: the values the "full" form reads from its cache
    own = _capped(_scaled(torch.matmul(qg, k_new.to(dtype).permute(0, 2, 3, 1)).view(b, hq, s, s), scaling), softcap)
    if mask.shape[-1] == c + s:  # the mask orders the new tokens (a prefix-LM's bidirectional prefix)
        own = own + mask[..., c:]
    elif own_mask is not None:
        own = own + own_mask
    elif s > 1:
        own = own + torch.full((s, s), torch.finfo(own.dtype).min, dtype=own.dtype, device=own.device).triu(1)
    probs = torch.softmax(torch.cat((cached, own), -1), dim=-1, dtype=at_least_fp32(dtype)).to(dtype)
    p_cached, p_own = probs[..., :c].reshape(b, hkv, g * s, c), probs[..., c:].reshape(b, hkv, g * s, s)
    out = torch.matmul(p_cached, v_cache.transpose(1, 2).to(dtype)) + torch.matmul(p_own, v_new.to(dtype).transpose(1, 2))
    return out.view(b, hq, s, d)


def fake(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
         k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, cache_update: str) -> tuple[Tensor, Tensor, Tensor]:
    """The outputs' shapes and dtypes (torch.export, FakeTensor)."""
    _check(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, cache_update)
    out_dtype = compute_dtype(x, wq, wk, wv, wo)
    if cache_update == "rows":
        rows = (*x.shape[:2], *k_cache.shape[2:])
        return (x.new_empty((*x.shape[:2], wo.shape[0]), dtype=out_dtype),
                k_cache.new_empty(rows), v_cache.new_empty(rows))
    return (x.new_empty((*x.shape[:2], wo.shape[0]), dtype=out_dtype),
            torch.empty_like(k_cache, memory_format=torch.contiguous_format),
            torch.empty_like(v_cache, memory_format=torch.contiguous_format))


def causal_mask(s: int, c: int, pos: int, dtype: torch.dtype = torch.float32, cache_update: str = "full") -> Tensor:
    """The additive mask [S, C] for S new tokens written at slot ``pos``: token i sees slots <= pos + i
    ("full"), or the slots before pos, which hold the earlier tokens ("rows": the new ones come
    as rows, and the input cache's slots from pos on are stale)."""
    if cache_update == "rows":
        visible = (torch.arange(c)[None, :] < pos).expand(s, c)
    else:
        visible = torch.arange(c)[None, :] <= (pos + torch.arange(s))[:, None]
    return torch.zeros(s, c, dtype=dtype).masked_fill(~visible, float("-inf"))


def sample_inputs(dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """(args, kwargs): prefill and decode, GQA and MQA, every mask layout, int32 pos, mixed dtypes."""
    g = torch.Generator().manual_seed(0)

    def layer(e=16, hq=4, hkv=2, d=4, s=3, c=8, pos=0, b=1, wdtype=dtype, cache_dtype=dtype):
        def r(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale)
        x = r(b, s, e).to(dtype)
        wq, wk, wv = (r(h * d, e, scale=e ** -0.5).to(wdtype) for h in (hq, hkv, hkv))
        wo = r(e, hq * d, scale=(hq * d) ** -0.5).to(wdtype)
        angles = (pos + torch.arange(s, dtype=torch.float64))[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))
        angles = torch.cat((angles, angles), -1)
        k_cache, v_cache = (r(b, c, hkv, d).to(cache_dtype) for _ in range(2))
        return [x, wq, wk, wv, wo, angles.cos().to(dtype), angles.sin().to(dtype),
                causal_mask(s, c, pos, dtype), k_cache, v_cache, torch.tensor([pos])]

    prefill = layer()
    decode = layer(s=1, pos=5)
    mqa = layer(hkv=1, b=2)
    mqa[7] = mqa[7][None].expand(2, 3, 8)  # [B, S, C]
    mha = layer(hq=2, hkv=2, s=2, pos=6)  # writes past the cache end are dropped
    mha[7] = mha[7][None, None]  # [B, 1, S, C]
    mha[10] = mha[10].to(torch.int32)
    rows = layer(s=1, pos=5)  # the in-place form: the new rows out, the mask hiding slots >= pos
    rows[7] = causal_mask(1, 8, 5, dtype, "rows")
    rows_prefill = layer(hkv=1, s=3, pos=2)
    rows_prefill[7] = causal_mask(3, 8, 2, dtype, "rows")
    samples = [(tuple(prefill), {}), (tuple(decode), {}), (tuple(mqa), {"scale": 0.3}), (tuple(mha), {}),
               (tuple(rows), {"cache_update": "rows"}), (tuple(rows_prefill), {"cache_update": "rows", "scale": 0.3})]
    if dtype != torch.float32 and dtype != torch.float64:
        samples.append((tuple(layer(wdtype=torch.float32, cache_dtype=torch.float32)), {}))  # fp32 weights and caches
    return samples
