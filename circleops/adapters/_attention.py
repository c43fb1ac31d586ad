"""The attention replacement: one circle.attention per HF attention layer, where the
Circle ATTENTION contract can express that layer, and the untouched HF forward where not.

ATTENTION is x → q/k/v projections (no bias) → GPT-NeoX RoPE over the whole head →
scores · 1/sqrt(D) + additive mask → softmax → · V → output projection. Anything else a
layer does between those steps (biases, q/k norms, logit soft-capping, a sliding window,
another score scale, partial rotary) makes :func:`attention_blockers` name it, and the
layer stays decomposed: the adapter never computes something different from HF.

The forward takes its caches from the ``circle_kv`` keyword (a :class:`StaticKV`, passed
down by the decoder layers' ``**kwargs``); without it the layer runs as a plain forward
over its own S positions (caches of S zero slots, pos 0, HF's causal mask). A layer with
blockers that gets the caches runs its decomposed forward over them instead
(adapters/_cached_attention.py), unless :func:`~circleops.adapters._cached_attention.cache_blockers`
says even that cannot be done.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)

from circleops.adapters._cached_attention import KV_KWARG, StaticKV, cache_blockers, layer_window
from circleops.adapters._patching import mark_ran, record_attention
from circleops.errors import CircleOpsError

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


def _rotary_factor(module: torch.nn.Module) -> float:
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", None) if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0)
    return float(factor if factor is not None else 1.0)


def attention_blockers(module: torch.nn.Module, rotary_dims: Optional[int] = None) -> list[str]:
    """Why circle.attention cannot compute this attention layer exactly; [] if it can.

    Decided from the layer's own modules, attributes and config, so layers of one model
    can differ (Gemma2/3 alternate sliding and full layers).
    """
    reasons = []
    biased = [n for n in _PROJECTIONS if getattr(getattr(module, n, None), "bias", None) is not None]
    if biased:
        reasons.append(f"biases on {', '.join(biased)} (ATTENTION's projections have no bias)")
    if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
        reasons.append("q/k norms between the projections and RoPE (ATTENTION has none)")
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        reasons.append(f"attention logit soft-capping at {softcap} (ATTENTION has none)")
    window = layer_window(module)
    if window is not None:
        reasons.append(f"sliding-window attention over {window} tokens (ATTENTION attends to the whole cache)")
    head_dim = getattr(module, "head_dim", None)
    scaling = getattr(module, "scaling", None)
    if head_dim is not None and scaling is not None and scaling != head_dim ** -0.5:
        reasons.append(f"score scale {scaling:.6g} is not 1/sqrt(head_dim) = {head_dim ** -0.5:.6g} (ATTENTION's scale is fixed)")
    factor = _rotary_factor(module)
    if factor < 1.0 or (rotary_dims is not None and head_dim is not None and rotary_dims != head_dim):
        reasons.append("partial rotary embedding (ATTENTION rotates every head dim)")
    if not getattr(module, "is_causal", True):
        reasons.append("bidirectional attention (not a causal decoder layer)")
    if module.training and getattr(module, "attention_dropout", 0.0):
        reasons.append("attention dropout in training mode")
    return reasons


def projection_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wq, wk, wv in torch Linear layout; Phi3's fused qkv_proj is split by rows."""
    if getattr(module, "qkv_proj", None) is not None:
        w = module.qkv_proj.weight
        d = module.head_dim
        nq = module.config.num_attention_heads * d
        nkv = module.config.num_key_value_heads * d
        return w[:nq], w[nq:nq + nkv], w[nq + nkv:]
    return module.q_proj.weight, module.k_proj.weight, module.v_proj.weight


def _additive_mask(mask: Optional[torch.Tensor], s: int, like: torch.Tensor) -> torch.Tensor:
    low = torch.finfo(like.dtype).min
    if mask is None:  # HF passes None when the attention is plainly causal
        return torch.full((s, s), low, dtype=like.dtype, device=like.device).triu(1)
    if mask.dtype == torch.bool:  # True = attend
        return torch.where(mask, torch.zeros((), dtype=like.dtype, device=like.device), low)
    return mask


def attention_forward(label: str, rope_label: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``forward`` for an HF attention class: circle.attention where the layer allows it,
    else ``original`` (the decomposed HF forward)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        mark_ran(label)
        kv: Optional[StaticKV] = kwargs.pop(KV_KWARG, None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if position_embeddings is None:  # an older caller that leaves RoPE to the layer
            return original(self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                            attention_mask=attention_mask, cache=cache, **kwargs)
        cos, sin = position_embeddings
        layer = getattr(self, "layer_idx", None)
        reasons = attention_blockers(self, cos.shape[-1])
        if cache is not None and kv is None:
            reasons.append("an HF Cache object was passed (circle.attention takes explicit caches; "
                           "see circleops.adapters.decode.DecoderWithCache)")
        if reasons and kv is not None:
            return _decomposed_with_cache(self, original, reasons, kv, hidden_states=hidden_states,
                                          position_embeddings=position_embeddings, attention_mask=attention_mask,
                                          **kwargs)
        if reasons:
            record_attention(type(self).__name__, -1 if layer is None else layer, False, "; ".join(reasons))
            return original(self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                            attention_mask=attention_mask, cache=cache, **kwargs)
        record_attention(type(self).__name__, -1 if layer is None else layer, True)
        mark_ran(rope_label)  # RoPE happens inside circle.attention
        wq, wk, wv = projection_weights(self)
        b, s, _ = hidden_states.shape
        d = self.head_dim
        if kv is None:
            k_cache = hidden_states.new_zeros((b, s, wk.shape[0] // d, d))
            v_cache = hidden_states.new_zeros((b, s, wv.shape[0] // d, d))
            pos = torch.zeros(1, dtype=torch.int64, device=hidden_states.device)
            mask = _additive_mask(attention_mask, s, hidden_states)
        else:
            if layer is None:
                raise CircleOpsError(f"{type(self).__name__} has no layer_idx; cannot pick its cache.")
            k_cache, v_cache, pos = kv.k[layer], kv.v[layer], kv.pos
            mask = attention_mask
        # the default form is left out of the call, so its exported graphs stay as they were
        form = {"cache_update": kv.cache_update} if kv is not None and kv.cache_update != "full" else {}
        out, k_new, v_new = torch.ops.circle.attention(
            hidden_states, wq, wk, wv, self.o_proj.weight, cos, sin, mask, k_cache, v_cache, pos, 0.0, **form)
        if kv is not None:
            kv.k[layer], kv.v[layer] = k_new, v_new
        return out, None

    forward.__name__ = "forward"
    forward.__qualname__ = f"{label}.forward[circle.attention]"
    forward.takes_circle_kv = True  # type: ignore[attr-defined]  (DecoderWithCache asks takes_explicit_caches)
    return forward


def takes_explicit_caches(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is :func:`attention_forward`'s (it reads DecoderWithCache's
    caches from the ``circle_kv`` keyword); another forward would ignore them."""
    return bool(getattr(module.forward, "takes_circle_kv", False))


def _decomposed_with_cache(module: torch.nn.Module, original: Callable[..., Any], reasons: list[str], kv: StaticKV, *,
                           hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any,
                           **kwargs: Any) -> Any:
    """A layer circle.attention cannot express, over the explicit caches: its own (fused)
    forward, whose attention function is adapters._cached_attention.cached_attention."""
    layer = getattr(module, "layer_idx", None)
    name = f"{type(module).__name__} layer {layer}"
    hard = cache_blockers(module)
    if hard:
        raise CircleOpsError(f"{name} has no explicit-cache attention: {'; '.join(hard)}.")
    record_attention(type(module).__name__, -1 if layer is None else layer, False, "; ".join(reasons))
    out = original(module, hidden_states=hidden_states, position_embeddings=position_embeddings,
                   attention_mask=attention_mask, cache=None, **{KV_KWARG: kv}, **kwargs)
    if layer not in kv.decomposed:
        raise CircleOpsError(f"{name}: its forward did not hand the explicit caches to its attention function "
                             "(it does not call transformers' ALL_ATTENTION_FUNCTIONS with its **kwargs), so it has "
                             "no explicit-cache graph. Fuse the model with circleops.fuse(model) first, or report "
                             "the model.")
    return out
