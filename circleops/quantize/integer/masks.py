"""Finite attention masks, before PT2E calibration of an unfused model.

A Hugging Face model masks attention by adding the dtype's lowest value (-3.4e38) to the
scores: ``where(allowed, 0, finfo.min)`` then ``scores + mask``. Quantized op by op (the
integer TFLite path, where attention is not one fused op), that ADD's observed range
reaches -3.4e38 and its scale ~1e34: every score rounds to zero, and LiteRT aborts
computing the ADD's rescaling multiplier. The mask's lowest value becomes ``MASK_VALUE``,
far enough below any score that softmax gives the masked positions nothing
(exp(MASK_VALUE) ~ 1e-28, under a 16-bit softmax step 3e-5), near enough that the
masked scores' tensor keeps a usable scale. fp32 outputs move by less than 1e-20.
"""
from __future__ import annotations

import math
from typing import Any

import torch

MASK_VALUE = -64.0  # in units of the attention logits
_HUGE = -1e30  # a value at or below this is an additive "minus infinity" mask


def _is_mask_scalar(a: Any) -> bool:
    return isinstance(a, float) and (a <= _HUGE or (math.isinf(a) and a < 0))


def finite_masks(ep: Any, value: float = MASK_VALUE) -> int:
    """Replace, in place, the "minus infinity" constants of ``ep`` (scalar arguments of
    where / masked_fill / full, and lifted constant tensors, not parameters) by ``value``; how many were replaced."""
    count = 0
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        args = list(node.args)
        hits = [i for i, a in enumerate(args) if _is_mask_scalar(a)]
        kw = {k: v for k, v in node.kwargs.items() if _is_mask_scalar(v)}
        if not hits and not kw:
            continue
        for i in hits:
            args[i] = value
        node.args = tuple(args)
        node.kwargs = {**node.kwargs, **{k: value for k in kw}}
        count += len(hits) + len(kw)
    for store in (ep.constants,):
        for name, t in list(store.items()):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and bool((t <= _HUGE).any()):
                store[name] = torch.where(t <= _HUGE, torch.full_like(t, value), t)
                count += 1
    if count:
        ep.graph_module.recompile()
    return count
