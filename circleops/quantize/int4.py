"""4-bit linear weights for LiteRT (``--target tflite --quantize int4`` and its block sizes).

What LiteRT 2.3.0 runs (measured on hand-built one-op files, bench/int4_litert.py; the
TFLite schema of ai_edge_litert.schema_py_generated):

* FULLY_CONNECTED with a FLOAT32 input [R, K], an INT4 weight [N, K] and a FLOAT32 output.
  The weight's QuantizationParameters carry the details ``BlockwiseQuantization`` {scales:
  the index of a FLOAT16 tensor [N, K / B], block_size B} (zero points none: symmetric).
  XNNPACK delegates it (its qd8-f32-qb4w GEMM) when B is a multiple of 32 and divides K
  (B = 8 or 16: not delegated, LiteRT's builtin kernel runs it, slowly); the builtin
  kernel computes the same values.
* or per output channel: INT4 with an fp32 scale per row (quantized_dimension 0, zero points
  0): XNNPACK's qd8-f32-qc4w. LiteRT's builtin kernel computes that one wrong (measured: the
  output off by 150 %), so it is written only for XNNPACK (the default delegate).
* INT4 data: two values per byte, element 2i in the low nibble, 2i+1 in the high one (what
  circleops.serialize.buffers.pack_4bit writes); a swapped order is off by ~100 %.
* XNNPACK quantizes each input row to int8 asymmetrically (the range [min(x, 0), max(x, 0)]
  onto -128..127, as for w8: int8.quantize_rows_asymmetric), takes the integer dot of each
  block and weighs it by the block's scale **rounded to bfloat16** (the delegate hands the
  FLOAT16 scales over as fp16, its packing stores bf16: an fp16 scale that is not a bf16
  value computes with a scale up to 2^-9 off, measured 1-2.5e-3 of the output). So circleops
  writes scales that are bf16 values inside fp16's normal range: fp16 stores them exactly and
  XNNPACK, the builtin kernel, the reference interpreter and torch on the dequantized weights
  all compute with the same scale. :func:`blockwise_linear` computes what XNNPACK does.
* EMBEDDING_LOOKUP (1-D int32 ids) of an INT8 table with one scale per row, or of an INT4
  table blockwise or per row, gives exactly the dequantized rows (float32 out); GATHER of a
  quantized table returns the raw integers, so an embedding is written as EMBEDDING_LOOKUP.

Each block's scale minimises sum_k importance[k] (w_k - s q_k)^2 over candidate roundings
(as ggml.quantize_q4_0_weighted: the largest magnitude onto -8, ±0.3/0.6/0.9 of a level, or
onto +7), where importance is the mean square of each input channel over the calibration text
(without one: all 1): each candidate's least-squares scale is rounded to the bf16 grid, the
levels rounded again at it, and the smallest resulting error wins.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from circleops.quantize import int8

DTYPE = "INT4"
FALLBACK = "INT8"  # a linear whose K takes no block of 32 (int8 per channel, w8's form)
DEFAULT_BLOCK = 32
# XNNPACK delegates a blockwise FULLY_CONNECTED only for blocks that are multiples of 32
# (measured: 16 and 8 fall back to LiteRT's builtin kernel)
XNNPACK_BLOCK_QUANTUM = 32
PER_CHANNEL = 0  # block size 0: one scale per output channel (qc4w)
LEVELS = (-8, 7)
# fp16's normal range, within which every bf16 value is an fp16 value (10 mantissa bits >= 7)
_SCALE_MIN = 2.0 ** -14
_SCALE_MAX = 65280.0  # the largest bf16 value below fp16's 65504
# t = x / (the block's signed largest magnitude) times these: it lands on -8 -+ a fraction of a
# level (ggml's make_qx_quants' candidates), or on +7 (the grid's other, shorter side)
_MULTIPLIERS = tuple(-(8.0 + s) for s in (-0.9, -0.6, -0.3, 0.0, 0.3, 0.6, 0.9)) + (6.5, 7.0, 7.4)
_CHUNK_VALUES = 1 << 19


class Int4Weight(NamedTuple):
    """A linear weight as the file stores it: int4 values [N, K] (one per int8) and scales:
    float16 [N, K / block] (blockwise), or float32 [N] (block 0: per output channel)."""

    q: np.ndarray  # int8 [N, K] in -8..7
    scales: np.ndarray  # float16 [N, K / block] or float32 [N]
    block: int  # columns per scale; 0: per output channel

    @property
    def nbytes(self) -> int:
        return int((self.q.size + 1) // 2 + self.scales.nbytes)


def block_for(k: int, block: int) -> int | None:
    """The block size a linear with inputs of length ``k`` is stored with, asked for ``block``
    (0: per channel, any ``k``): ``block`` when it divides ``k``, else the largest multiple of
    32 below it that does (XNNPACK delegates only those), else None (int8 per channel)."""
    if block == PER_CHANNEL:
        return PER_CHANNEL
    for b in range(block, XNNPACK_BLOCK_QUANTUM - 1, -XNNPACK_BLOCK_QUANTUM):
        if k % b == 0:
            return b
    return None


def to_bf16_grid(scale: Tensor) -> Tensor:
    """``scale`` (float32, >= 0) rounded to bfloat16 (half to even) and clamped into fp16's
    normal range (a zero stays zero): a value fp16 stores exactly and XNNPACK keeps as it is."""
    s = scale.to(torch.bfloat16).to(torch.float32)
    return torch.where(s == 0, s, s.clamp(_SCALE_MIN, _SCALE_MAX))


def _signed_absmax(x: Tensor) -> Tensor:
    idx = x.abs().argmax(dim=1, keepdim=True)
    return x.gather(1, idx)


def _levels(x: Tensor, s: Tensor) -> Tensor:
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    return torch.mul(x, inv).round_().clamp_(*LEVELS)


def _quantize_blocks(x: Tensor, imp: Tensor) -> tuple[Tensor, Tensor]:
    """(levels int8 [B, G], bf16-grid scales float32 [B]) of blocks ``x`` [B, G]: of the
    candidate roundings (the block's largest magnitude onto -8 - s or 7 + s levels), the one
    whose least-squares scale, on the bf16 grid, leaves the smallest weighted error once the
    levels are rounded again at that scale (what the file holds)."""
    mx = _signed_absmax(x)
    mx = torch.where(mx == 0, torch.ones_like(mx), mx)
    t = x / mx
    qx = imp * x
    best_err = torch.full_like(mx, float("inf"))
    best_s = torch.zeros_like(mx)
    for mult in _MULTIPLIERS:
        lv = torch.mul(t, mult).round_().clamp_(*LEVELS)
        sumlx = (qx * lv).sum(1, keepdim=True)
        suml2 = (imp * lv * lv).sum(1, keepdim=True).clamp_min(1e-30)
        s = to_bf16_grid((sumlx / suml2).abs())
        err = (imp * (x - _levels(x, s) * s) ** 2).sum(1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
    return _levels(x, best_s).to(torch.int8), best_s.reshape(-1)


def quantize(weight: Tensor | np.ndarray, block: int = DEFAULT_BLOCK, importance: Tensor | None = None) -> Int4Weight:
    """``weight`` [N, K] as int4 blocks of ``block`` columns (0: one scale per row), scales
    fitted to ``importance`` [K] (the mean square of each input channel; None: all equal)."""
    w = weight.detach() if isinstance(weight, Tensor) else torch.from_numpy(np.asarray(weight))
    w = w.to(torch.float32).cpu()
    if w.dim() != 2:
        raise ValueError(f"an int4 weight needs an [N, K] matrix, got {list(w.shape)}")
    n, k = w.shape
    g = k if block == PER_CHANNEL else block
    if g < 1 or k % g:
        raise ValueError(f"int4 blocks of {block} do not divide K={k} (circleops.quantize.int4.block_for)")
    imp = torch.ones(k) if importance is None else importance.detach().to(torch.float32).reshape(-1).cpu()
    if imp.numel() != k:
        raise ValueError(f"importance has {imp.numel()} values for a weight with K={k}")
    # a floor keeps a block whose inputs never fired (importance 0) quantized by magnitude
    imp = imp.clamp_min(max(float(imp.max()), 1e-30) * 1e-6).reshape(1, k // g, g)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // g, dtype=torch.float32)
    rows = max(1, _CHUNK_VALUES // k)
    for start in range(0, n, rows):
        part = w[start:start + rows]
        r = part.shape[0]
        blocks = part.reshape(r * (k // g), g)
        lv, s = _quantize_blocks(blocks, imp.expand(r, -1, -1).reshape(-1, g))
        q[start:start + r] = lv.reshape(r, k)
        scales[start:start + r] = s.reshape(r, k // g)
    # an all-zero block (a padding token's row of a tied head) has levels 0 at any scale: the
    # smallest one instead of 0, which XNNPACK refuses ("unsupported scale value (0.000000)"):
    # the whole file then fails to prepare
    scales = torch.where(scales == 0, torch.full_like(scales, _SCALE_MIN), scales)
    if block == PER_CHANNEL:  # fp32 scales in the QuantizationParameters (qc4w)
        return Int4Weight(q.numpy(), scales.reshape(n).numpy(), PER_CHANNEL)
    return Int4Weight(q.numpy(), scales.to(torch.float16).numpy(), block)


def expanded_scales(packed: Int4Weight) -> Tensor:
    """float32 [N, K] scale of every weight (bf16-rounded, as XNNPACK computes with)."""
    s = torch.from_numpy(np.asarray(packed.scales, np.float32).copy())
    if packed.block == PER_CHANNEL:
        return s.reshape(-1, 1).expand(packed.q.shape)
    s = s.to(torch.bfloat16).to(torch.float32)
    return s.repeat_interleave(packed.block, dim=1)


def dequantize(packed: Int4Weight) -> Tensor:
    """The float32 [N, K] values the file computes with: q * s."""
    return torch.from_numpy(packed.q).to(torch.float32) * expanded_scales(packed)


def blockwise_linear(x: Tensor, q: Tensor, scales: Tensor, block: int, bias: Tensor | None = None) -> Tensor:
    """LiteRT's XNNPACK FULLY_CONNECTED of float32 ``x`` [R, K] with int4 ``q`` [N, K]: each
    row quantized to int8 asymmetrically (int8.quantize_rows_asymmetric), the integer dot of
    each block of ``block`` columns (0: the whole row) weighed by its scale (``scales``
    [N, K / block] rounded to bf16, or [N] per channel), times the row's scale."""
    n, k = q.shape
    if block == PER_CHANNEL:
        return int8.dynamic_range_linear(x, q, scales.to(torch.float32).reshape(-1), bias)
    xq, sx, _ = int8.quantize_rows_asymmetric(x)
    nb = k // block
    s = scales.to(torch.float32).to(torch.bfloat16).to(torch.float64).reshape(n, nb)
    # exact block sums in float64 (|sum| <= 32 * 128 * 8 per block)
    acc = torch.einsum("rbj,nbj->rnb", xq.reshape(-1, nb, block), q.to(torch.float64).reshape(n, nb, block))
    y = ((acc * s).sum(-1) * sx.to(torch.float64)).to(torch.float32)
    return y if bias is None else y + bias.to(torch.float32)


# The codec interface of circleops.quantize.formats (the format registry asks these).
BLOCK = 1  # any K: a width without a block of 32 falls back to int8 per channel (FALLBACK)


def encode(weight: Tensor | np.ndarray, dtype: str = DTYPE, importance: Tensor | None = None,
           block: int = DEFAULT_BLOCK) -> Int4Weight | int8.Int8Weight:
    """``weight`` [N, K] as ``dtype``: INT4 in the block ``block_for`` gives its K (the caller
    checked there is one), or INT8 per channel (the fallback, and an 8-bit head / table)."""
    if dtype == FALLBACK:
        return int8.quantize_per_channel(weight)
    b = block_for(int(weight.shape[-1]), block)
    if b is None:
        raise ValueError(f"K={int(weight.shape[-1])} takes no int4 block of {block} or a multiple of 32 below")
    return quantize(weight, b, importance)


def decode(packed: Int4Weight | int8.Int8Weight, dtype: str = DTYPE, shape: tuple[int, ...] | None = None) -> Tensor:
    """The float32 values of ``packed`` (as ``shape`` when given)."""
    values = int8.dequantize(packed) if isinstance(packed, int8.Int8Weight) else dequantize(packed)
    return values.reshape(shape) if shape is not None else values


def decode_into(packed: Int4Weight | int8.Int8Weight, dtype: str, out: Tensor) -> Tensor:
    """The values of ``packed`` written into the contiguous float32 ``out``."""
    if isinstance(packed, int8.Int8Weight):
        return int8.dequantize_into(packed, out)
    return out.view(packed.q.shape).copy_(dequantize(packed)).view(out.shape)
