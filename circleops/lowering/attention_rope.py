"""A decomposed attention's RoPE of q and k as one rotation, with fewer ops (issue 34).

Written inline (target tflite's generation graphs: ``TargetProfile.graph_inline_ops``), the
attention reference rotates q and k apart, each as x·cos + rotate_half(x)·sin with
rotate_half = CONCAT(NEG(SLICE), SLICE): 7 ops each, and then scales the scores over the cache
and over the step's own key by 1/sqrt(D): 16 ops a layer of the ~64 a SmolLM2 decode step runs. XNNPACK runs each op for a few hundred nanoseconds of dispatch whatever its size
(and at 2 threads may hand it to the other thread), so on a one-token step they cost about as
much as a few weights' worth of products. :func:`joint_rope` (the reference's ``rope_qk``
hook, ``TargetProfile.attention_joint_rope``) writes instead:

* q and k concatenated over heads and rotated once;
* rotate_half as a product with a constant signed permutation matrix R (x @ R: each output is
  one input, negated or not, plus zeros: exact in any float arithmetic with finite inputs), one
  BATCH_MATMUL whose constant operand XNNPACK packs once (a FULLY_CONNECTED would be taken for a
  linear by the weight formats and quantized);
* the scores' scaling, when it is a power of two (1/sqrt(D) for D = 4^n: SmolLM2's 64), folded
  into q's rows by one multiply (a power of two scales every product and partial sum of q·kᵀ
  exactly, so the scores are bit-equal); another scaling stays on the scores, where the
  reference puts it.

The outputs are bit-equal to the plain decomposition's (tests/lowering/test_attention_rope.py);
SmolLM2's int4 decode step runs 1737 ops instead of 1917, and at 2 threads hands 451 instead of
541 of them to the other thread (bench/results/71-*).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from circleops.ops import rope


def rotate_half_matrix(d: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """R [1, d, d] with x @ R = cat(-x[..., d/2:], x[..., :d/2]) (HF's rotate_half). Built from
    factory and elementwise ops (no in-place writes), so that a lowering's trace, which runs on
    meta tensors, folds it into one constant."""
    h = d // 2
    i = torch.arange(d, device=device)
    row, col = i[:, None], i[None, :]
    # output j < h reads -x[j + h] (row j + h); output j >= h reads x[j - h] (row j - h)
    r = (col == row + h).to(dtype) - (col == row - h).to(dtype)
    return r[None]


def power_of_two(x: float) -> bool:
    """Whether x is 2^n (a multiply by it is exact in binary floating point, barring range)."""
    return x > 0 and math.frexp(x)[0] == 0.5


def joint_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, scaling: float) -> tuple[Tensor, Tensor, float]:
    """GPT-NeoX RoPE of q [B, Hq, S, D] and k [B, Hkv, S, D] as one rotation; returns (q', k',
    scaling'): q' = rope(q)·scaling and scaling' = 1 when scaling is a power of two and q is
    float32 (in fp16 the folded q could lose digits below its normal range), else q' = rope(q)
    and scaling' = scaling. Partial rotary (cos narrower than D) is rotated apart, by
    circle::rope's reference kernel (plain ops, as the inline attention writes it without this hook)."""
    b, hq, s, d = q.shape
    if cos.shape[-1] != d or d % 2:
        return rope.reference(q, cos, sin, "gpt_neox"), rope.reference(k, cos, sin, "gpt_neox"), scaling
    qk = torch.cat((q, k), 1)
    heads = qk.shape[1]
    c, sn = rope.broadcastable(cos), rope.broadcastable(sin)
    r = rotate_half_matrix(d, qk.dtype, qk.device)
    rotated = torch.matmul(qk.reshape(1, b * heads * s, d), r).reshape(qk.shape)
    y = (qk * c) + (rotated * sn)  # circle::rope's order (HF's): x·cos + rotate_half(x)·sin
    if qk.dtype == torch.float32 and power_of_two(scaling) and scaling != 1.0:
        head = torch.arange(heads, device=qk.device)
        per_head = torch.where(head < hq, scaling, 1.0).to(qk.dtype).reshape(1, heads, 1, 1)
        y = y * per_head
        scaling = 1.0
    return y[:, :hq], y[:, hq:], scaling


__all__ = ["joint_rope", "power_of_two", "rotate_half_matrix"]
