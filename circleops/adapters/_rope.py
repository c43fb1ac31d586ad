"""The RoPE replacement: HF's module-level ``apply_rotary_pos_emb`` as two circle.rope calls.

HF calls ``apply_rotary_pos_emb(q, k, cos, sin)`` from the attention forward, with q, k
[B, H, S, D] and cos, sin [B, S, R]; R < D is partial rotary (Phi3 with
partial_rotary_factor < 1), which circle.rope expresses directly.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)

from circleops.adapters._patching import mark_ran


def rope_function(label: str, original: Callable[..., Any], cast_back: bool = False) -> Callable[..., Any]:
    """A drop-in ``apply_rotary_pos_emb`` computing q and k with circle.rope.

    ``cast_back``: the family casts the results back to q/k's dtype (OLMo2), which
    matters only when cos/sin have a wider dtype than q/k.
    """

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or unsqueeze_dim not in (1, 2) or len(args) > 1:
            return original(q, k, cos, sin, *args, **kwargs)  # a layout circle.rope does not take
        mark_ran(label)
        if unsqueeze_dim == 2:  # q, k are [B, S, H, D]
            q_out = torch.ops.circle.rope(q.transpose(1, 2), cos, sin, "gpt_neox").transpose(1, 2)
            k_out = torch.ops.circle.rope(k.transpose(1, 2), cos, sin, "gpt_neox").transpose(1, 2)
        else:
            q_out = torch.ops.circle.rope(q, cos, sin, "gpt_neox")
            k_out = torch.ops.circle.rope(k, cos, sin, "gpt_neox")
        if cast_back:
            q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
        return q_out, k_out

    apply_rotary_pos_emb.__qualname__ = f"{label}[circle.rope]"
    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb
