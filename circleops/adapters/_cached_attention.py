"""Attention over DecoderWithCache's explicit caches, decomposed, for the layers circle.attention
cannot express: q/k/v biases (Qwen2/2.5), q/k norms (Qwen3, OLMo2, Gemma3), logit
soft-capping, another score scale and sliding windows (Gemma 2/3), partial rotary (Phi3).

The layer runs its own Hugging Face forward (fused by :func:`circleops.fuse`: its q/k norms
are circle.rms_norm, its RoPE circle.rope), with no HF cache, so the projections, biases,
norms and rotary are transformers' own code. Where that forward calls its attention
function, :class:`CacheAttentionFunctions` (standing in for transformers'
``ALL_ATTENTION_FUNCTIONS`` in the fused forward's globals) hands the call to
:func:`cached_attention` when it carries the caches (the ``circle_kv`` keyword,
:data:`KV_KWARG`): it writes the new keys and values exactly as circle.attention does (the
same cache inputs and outputs, every ``cache_update`` form and cache layout) and attends with
the same kernels (circleops.ops.attention's ``attend_cache`` / ``attend_rows``), with the
layer's own score scale and soft-capping, under the mask DecoderWithCache built for the
layer's sliding window (:func:`slot_mask`, :func:`own_mask`: the one place those masks are
computed from ``pos``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from circleops.errors import CircleOpsError
from circleops.ops.attention import attend_cache, attend_rows, update_cache

KV_KWARG = "circle_kv"
# keywords transformers' layers pass on to the attention function that change nothing here
# (the positions are in the mask and cos/sin already)
_HARMLESS = {"position_ids", "cache_position", "output_attentions", "use_cache", "is_causal"}


@dataclass
class StaticKV:
    """Explicit caches for one step: per layer k/v [B, C, Hkv, D], the slot of the first new
    token, and (after the step) the updated caches, written in place of the inputs; with
    ``cache_update="rows"`` (circle.attention's in-place form) the new rows [B, S, Hkv, D]
    instead, for the caller to write at ``pos``. ``decomposed``: the layers whose attention
    ran through :func:`cached_attention`."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pos: torch.Tensor
    cache_update: str = "full"
    decomposed: set[int] = field(default_factory=set)


def layer_window(module: torch.nn.Module) -> Optional[int]:
    """The layer's sliding window in tokens, or None (full attention), as transformers' model
    forward decides which mask a layer gets: by ``config.layer_types[layer_idx]`` where the
    config has layer types (Qwen2, Gemma 2/3; a Qwen2-MoE full layer has no window whatever
    config.sliding_window holds), else config.sliding_window for every layer (Mistral, Phi3)."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if types is not None and layer is not None and layer < len(types):
        return getattr(config, "sliding_window", None) if types[layer] == "sliding_attention" else None
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(config, "sliding_window", None)


def cache_blockers(module: torch.nn.Module) -> list[str]:
    """Why even the decomposed cached attention cannot compute this layer; [] if it can."""
    reasons = []
    if not getattr(module, "is_causal", True):
        reasons.append("bidirectional attention (not a causal decoder layer)")
    types = getattr(getattr(module, "config", None), "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if types is not None and layer is not None and layer < len(types) and \
            types[layer] not in ("full_attention", "sliding_attention"):
        reasons.append(f"a {types[layer]} layer (only full and sliding-window attention have cached graphs)")
    if module.training and getattr(module, "attention_dropout", 0.0):
        reasons.append("attention dropout in training mode (call model.eval())")
    return reasons


def slot_mask(pos: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_update: str,
              dtype: torch.dtype, window: Optional[int] = None) -> torch.Tensor:
    """The additive mask over the C cache slots, [1, 1, S or 1, C], for the S new tokens at
    ``positions`` [1, S] (= pos .. pos+S-1).

    "full": slot c is visible to new token i iff c <= pos + i (written already, or now).
    "rows": iff c < pos (the new tokens' own keys come as rows; slots from pos on are stale).
    ``window`` w: also iff c > pos + i - w, transformers' sliding window (a token sees itself
    and the w - 1 tokens before it: masking_utils.sliding_window_overlay)."""
    p = pos.reshape(1, 1).to(torch.int64)
    if cache_update == "rows":
        visible = slots[None, :] < p  # [1, C], the same for every row
    else:
        visible = slots[None, :] <= positions[0, :, None]  # [S, C]
    if window is not None:
        visible = visible & (slots[None, :] > positions[0, :, None] - window)  # [S, C]
    mask = torch.zeros(visible.shape, dtype=dtype, device=slots.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def own_mask(s: int, dtype: torch.dtype, window: Optional[int] = None,
             device: Optional[torch.device] = None) -> torch.Tensor:
    """The "rows" form's additive mask [1, 1, S, S] among the S new tokens: new token i sees
    new token j iff j <= i, and (``window`` w) i - j < w. A constant of S alone."""
    i = torch.arange(s, device=device)
    visible = i[None, :] <= i[:, None]
    if window is not None:
        visible = visible & (i[:, None] - i[None, :] < window)
    return torch.zeros((s, s), dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def cached_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``eager_attention_forward``'s) over the
    explicit caches in ``kwargs[KV_KWARG]``: query [B, Hq, S, D], key/value [B, Hkv, S, D] of
    the S new tokens (RoPE'd key); returns (out [B, S, Hq, D], None) and records the layer's
    updated caches ("full") or new rows ("rows") in the StaticKV.

    ``attention_mask`` is the layer's mask from DecoderWithCache: [.., S, C] ("full", and
    "rows" when S = 1), or [.., S, C + S] ("rows": the cache slots, then the new tokens); its
    sliding window is in it (``sliding_window``, a hint for flash kernels, is not needed).
    The keywords transformers passes, read here: ``dropout`` (must be 0), ``scaling`` (None:
    head_dim ** -0.5), ``softcap``; ``sliding_window`` is ignored, and any other keyword
    that is not None and not harmless (:data:`_HARMLESS`) is refused.
    """
    kv: StaticKV = kwargs.pop(KV_KWARG)
    dropout, scaling, softcap = kwargs.pop("dropout", 0.0), kwargs.pop("scaling", None), kwargs.pop("softcap", None)
    kwargs.pop("sliding_window", None)
    layer = getattr(module, "layer_idx", None)
    name = f"{type(module).__name__} layer {layer}"
    others = sorted(k for k, v in kwargs.items() if v is not None and k not in _HARMLESS)
    if others:
        raise CircleOpsError(f"{name}: its attention function is called with {', '.join(others)}, which the "
                             "decomposed cached attention does not implement; it has no explicit-cache graph.")
    if dropout:
        raise CircleOpsError(f"{name}: attention dropout {dropout} (call model.eval() before converting).")
    if layer is None:
        raise CircleOpsError(f"{type(module).__name__} has no layer_idx; cannot pick its cache.")
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    k_new, v_new = key.transpose(1, 2).to(k_cache.dtype), value.transpose(1, 2).to(v_cache.dtype)  # [B, S, Hkv, D]
    dtype = query.dtype
    if kv.cache_update == "rows":
        c, s = k_cache.shape[1], query.shape[2]
        own = attention_mask[..., c:] if attention_mask.shape[-1] == c + s else None
        out = attend_rows(query, k_cache, v_cache, k_new, v_new, attention_mask[..., :c], scaling, dtype,
                          softcap=softcap, own_mask=own)
        kv.k[layer], kv.v[layer] = k_new, v_new
    else:
        k_cache, v_cache = update_cache(k_cache, k_new, kv.pos), update_cache(v_cache, v_new, kv.pos)
        out = attend_cache(query, k_cache, v_cache, attention_mask, scaling, dtype, softcap=softcap)
        kv.k[layer], kv.v[layer] = k_cache, v_cache
    kv.decomposed.add(layer)
    return out.transpose(1, 2).contiguous(), None


class CacheAttentionFunctions:
    """Stands in for transformers' ``ALL_ATTENTION_FUNCTIONS`` in the globals of a fused
    attention forward: ``get_interface`` gives the function the layer asks for, except that a
    call carrying the explicit caches (:data:`KV_KWARG`) goes to :func:`cached_attention`."""

    def __init__(self, functions: Any):
        self._functions = functions

    def get_interface(self, implementation: Any, default: Any) -> Any:
        chosen = self._functions.get_interface(implementation, default)

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if KV_KWARG in kwargs:  # transformers passes dropout, scaling, ... by keyword
                return cached_attention(module, query, key, value, attention_mask, **kwargs)
            return chosen(module, query, key, value, attention_mask, *args, **kwargs)

        return attention

    def __getattr__(self, name: str) -> Any:
        return getattr(self._functions, name)

    def __getitem__(self, name: str) -> Any:
        return self._functions[name]

    def __contains__(self, name: object) -> bool:
        return name in self._functions
