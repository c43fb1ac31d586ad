"""int8 per-channel linear weights for onert's hybrid FULLY_CONNECTED (``--quantize w8``).

What onert 0.1.0 runs on any x86-64 (shared/FACTS.md, "onert quantized weights"; measured
on hand-built single-FC files, 2026-12-01): FULLY_CONNECTED with a FLOAT32 input [R, K], an
INT8 weight [N, K] and a FLOAT32 output. onert reads only scale[0] of the weight (per-channel scales give wrong results) and
ignores zero points, so the file holds the weight with scale [1.0], zero point [0], and a MUL
by a constant FLOAT32 [N] vector restores each output channel's scale:

    s[n] = max|W[n, :]| / 127,   q = clip(round(W / s), -127, 127)   (ties away from zero)

onert quantizes the input per row, symmetric (cker's SymmetricQuantizeFloats):
s_x = max|x_row| / 127 and x_q = round(x * (127 / max|x_row|)), half away from zero, clipped
to +-127; then y = float(int32 dot(x_q, q)) * s_x. ``hybrid_linear`` computes exactly that
(the reference interpreter's kernel), the MUL by s is its own op.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

DTYPE = "INT8"
# rows per step of the packing: a cache-sized [rows, K] block of float temporaries
_CHUNK_VALUES = 1 << 20


class Int8Weight(NamedTuple):
    """A linear weight as the file stores it: int8 values [N, K] and fp32 scales [N]."""

    q: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N]

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)


def _round_away(v: Tensor) -> Tensor:
    """Half away from zero (std::round, TfLiteRound); a 0 stays 0 (sign of -0.0 kept)."""
    return v.abs().add_(0.5).floor_().copysign_(v)


def quantize_per_channel(weight: Tensor | np.ndarray) -> Int8Weight:
    """``weight`` [N, K] as int8 per output channel: s = max|row| / 127 (a zero row: s = 1),
    q = clip(round(W / s), -127, 127), rounded half away from zero. Vectorized in torch, a
    chunk of rows at a time."""
    w = weight.detach() if isinstance(weight, Tensor) else torch.from_numpy(np.asarray(weight))
    w = w.to(torch.float32).cpu()
    if w.dim() != 2:
        raise ValueError(f"an int8 per-channel weight needs an [N, K] matrix, got {list(w.shape)}")
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    rows = max(1, _CHUNK_VALUES // max(k, 1))
    for start in range(0, n, rows):
        part = w[start:start + rows]
        s = part.abs().amax(dim=1).div_(127.0)
        s = torch.where(s == 0, torch.ones_like(s), s)
        v = part / s[:, None]
        q[start:start + rows] = _round_away(v).clamp_(-127, 127).to(torch.int8)
        scale[start:start + rows] = s
    return Int8Weight(q.numpy(), scale.numpy())


def dequantize(packed: Int8Weight) -> Tensor:
    """The float32 [N, K] values the file computes with: q * s."""
    return torch.from_numpy(packed.q).to(torch.float32) * torch.from_numpy(packed.scale)[:, None]


def dequantize_into(packed: Int8Weight, out: Tensor) -> Tensor:
    """q * s written into the contiguous float32 ``out`` (verify swaps it into the model)."""
    o = out.view(packed.q.shape)
    o.copy_(torch.from_numpy(packed.q))
    return o.mul_(torch.from_numpy(packed.scale)[:, None]).view(out.shape)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """onert's per-row symmetric input quantization of ``x`` [R, K] (float32): (x_q as
    float64 [R, K] in -127..127, the row scales max|x_row| / 127 as float32 [R, 1]; 1 for
    an all-zero row, whose x_q is 0)."""
    x = x.to(torch.float32)
    rng = x.abs().amax(dim=1, keepdim=True)
    zero = rng == 0
    safe = torch.where(zero, torch.ones_like(rng), rng)
    inv = torch.tensor(127.0, dtype=torch.float32) / safe  # fp32, as cker's scaling_factor_inv
    xq = _round_away(x * inv).clamp_(-127, 127)
    xq = torch.where(zero, torch.zeros_like(xq), xq)
    sx = torch.where(zero, torch.ones_like(rng), safe / torch.tensor(127.0, dtype=torch.float32))
    return xq.to(torch.float64), sx


def hybrid_linear(x: Tensor, q: Tensor, weight_scale: float = 1.0, bias: Tensor | None = None) -> Tensor:
    """onert's hybrid FULLY_CONNECTED: float32 ``x`` [R, K], int8 ``q`` [N, K] with one
    scale -> float32 [R, N] = bias + float(int dot(x_q, q)) * (s_x * weight_scale). The
    integer dot is exact in float64 (|sum| < 2^53)."""
    xq, sx = quantize_rows(x)
    acc = (xq @ q.to(torch.float64).T).to(torch.float32)
    y = acc * (sx * torch.tensor(weight_scale, dtype=torch.float32))
    return y if bias is None else y + bias.to(torch.float32)


def quantize_rows_asymmetric(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """XNNPACK's dynamic quantization of ``x`` [R, K] (float32) for its qd8 products, which
    LiteRT's default delegate runs a dynamic-range FULLY_CONNECTED with: per row, the range
    [min(x, 0), max(x, 0)] onto -128..127 with a nudged zero point
    (xnn_f32_qd8_asymmetric_quantization_params). Returns (x_q - zero point as float64
    [R, K], the row scales 1 / (255 / range) as float32 [R, 1], the zero points [R, 1])."""
    x = x.to(torch.float32)
    rmin = torch.clamp(x.amin(dim=1, keepdim=True), max=0.0)
    rmax = torch.clamp(x.amax(dim=1, keepdim=True), min=0.0)
    same = rmin == rmax
    scale = torch.where(same, torch.ones_like(rmin), torch.tensor(255.0, dtype=torch.float32) /
                        torch.where(same, torch.ones_like(rmin), rmax - rmin))
    lo, hi = rmin * scale, rmax * scale
    zp = torch.where((-128.0 + lo) + (127.0 + hi) > 0, -128.0 - lo, 127.0 - hi)
    zp = torch.round(zp.clamp(-128.0, 127.0))  # rintf: half to even, as torch.round
    xq = torch.clamp(torch.round(x * scale) + zp, -128.0, 127.0)
    return (xq - zp).to(torch.float64), torch.tensor(1.0, dtype=torch.float32) / scale, zp


def dynamic_range_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """LiteRT's dynamic-range FULLY_CONNECTED as its XNNPACK delegate computes it: float32 ``x``
    [R, K] quantized per row, asymmetric (:func:`quantize_rows_asymmetric`), an integer dot
    with int8 ``q`` [N, K], times the row's scale and each channel's ``scales`` [N]. (LiteRT's
    builtin kernel, without XNNPACK, quantizes rows symmetrically as onert does: hybrid_linear.)"""
    xq, sx, _ = quantize_rows_asymmetric(x)
    acc = (xq @ q.to(torch.float64).T).to(torch.float32)
    y = acc * (sx * scales.to(torch.float32).reshape(1, -1))
    return y if bias is None else y + bias.to(torch.float32)


# The codec interface of circleops.quantize.formats (the format registry asks these).
BLOCK = 1  # any K


def encode(weight: Tensor | np.ndarray, dtype: str = DTYPE, importance: object = None) -> Int8Weight:
    """``weight`` [N, K] as the file stores it (``quantize_per_channel``; no importances)."""
    return quantize_per_channel(weight)


def decode(packed: Int8Weight, dtype: str = DTYPE, shape: tuple[int, ...] | None = None) -> Tensor:
    """The float32 values of ``packed`` (as ``shape`` when given)."""
    values = dequantize(packed)
    return values.reshape(shape) if shape is not None else values


def decode_into(packed: Int8Weight, dtype: str, out: Tensor) -> Tensor:
    """``dequantize_into`` under the codec interface's signature."""
    return dequantize_into(packed, out)
