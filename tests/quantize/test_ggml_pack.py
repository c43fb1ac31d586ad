"""The block packers in torch (circleops.quantize.ggml) against their references: ggml's
reference Q4_0 / Q8_0 rounding against gguf's own numpy quantizer, byte for byte, and the
importance-weighted Q4_0 search against the plain per-chunk form it replaced (argmax for the
largest magnitude, uint8 shifts for the nibbles), on data that hits the edge cases: all-zero
and signed-zero blocks, two equal magnitudes of opposite sign, exact .5 roundings, scales
below fp16's normal range and above its maximum, a row longer than a chunk."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from circleops.quantize import ggml

TYPES = {"GGML_Q4_0": gguf.GGMLQuantizationType.Q4_0, "GGML_Q8_0": gguf.GGMLQuantizationType.Q8_0}


def _edge_weights(rows: int = 40, k: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    w[0, :32] = 0.0
    w[0, 32:64] = -0.0
    w[1, :32] = np.where(np.arange(32) % 2, 0.0, -0.0).astype(np.float32)
    w[1, 32:64] = np.where(np.arange(32) == 0, 0.0, -0.0).astype(np.float32)
    w[1, 64:96] = np.where(np.arange(32) == 31, 0.0, -0.0).astype(np.float32)
    w[1, 96:128] = np.where(np.arange(32) == 0, -0.0, 0.0).astype(np.float32)
    w[2, :32] = rng.integers(-3, 4, 32)  # small integers: many equal magnitudes
    w[2, 5], w[2, 9] = -3.0, 3.0  # a tie of opposite sign: the first one wins
    w[3, :32] = (np.arange(32) - 15.5).astype(np.float32)  # x / d lands on .5 exactly
    w[3, 32:64] = np.linspace(-127, 127, 32).astype(np.float32) / 4
    w[4, :32] *= 1e-7  # d below fp16's smallest normal
    w[5, :32] *= 1e7  # d past fp16's largest: inf, as gguf writes it
    w[6] = rng.integers(-8, 8, k).astype(np.float32) * 0.25  # values on the Q4_0 grid
    return w


@pytest.mark.parametrize("dtype", list(TYPES))
def test_reference_rounding_is_gguf_byte_for_byte(dtype):
    for seed in range(3):
        w = _edge_weights(seed=seed)
        with np.errstate(over="ignore"):  # the scale past fp16's range
            expected = gguf.quants.quantize(w, TYPES[dtype]).reshape(-1)
        np.testing.assert_array_equal(ggml.quantize(w, dtype), expected)
        np.testing.assert_array_equal(ggml.quantize(torch.from_numpy(w), dtype), expected)
    # more blocks than a chunk, a 3-D weight, a read-only array (an mmap'd file)
    big = np.random.default_rng(7).standard_normal((3, 50, 32 * 90)).astype(np.float32)
    big.setflags(write=False)
    np.testing.assert_array_equal(ggml.quantize(big, dtype), gguf.quants.quantize(big, TYPES[dtype]).reshape(-1))


def test_a_weight_whose_rows_are_not_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml.quantize(np.zeros((2, 40), np.float32), "GGML_Q8_0")
    with pytest.raises(ValueError, match="not a GGML block type"):
        ggml.quantize(np.zeros((2, 32), np.float32), "GGML_Q5_0")


def _reference_best_scale(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The scale search as first written: argmax for the largest magnitude, the same steps."""
    mx = x.gather(1, x.abs().argmax(1, keepdim=True))
    mx = torch.where(mx == 0, torch.ones_like(mx), mx)
    t = x / mx
    qx = q * x
    ones = torch.ones(32, 1)
    levels, prod = torch.empty_like(x), torch.empty_like(x)
    best = torch.full_like(mx, -1.0)
    scale = torch.zeros_like(mx)
    for step in (-0.9, -0.6, -0.3, 0.0, 0.3, 0.6, 0.9):
        torch.mul(t, -(8.0 + step), out=levels)
        levels.round_().clamp_(-8, 7)
        sumlx = torch.mm(torch.mul(qx, levels, out=prod), ones)
        suml2 = torch.mm(torch.mul(levels, levels, out=prod).mul_(q), ones)
        score = sumlx * sumlx / suml2
        better = score > best
        best = torch.where(better, score, best)
        scale = torch.where(better, sumlx / suml2, scale)
    return scale


def _reference_weighted(w: np.ndarray, imp: np.ndarray) -> np.ndarray:
    x_all = torch.from_numpy(w).reshape(-1, 32)
    q = torch.from_numpy(imp).clamp_min(max(float(imp.max()), 1e-30) * 1e-6).reshape(-1, 32)
    q_all = q.repeat(w.shape[0], 1)
    out = []
    for start in range(0, x_all.shape[0], 1 << 14):
        x = x_all[start:start + (1 << 14)]
        d16 = _reference_best_scale(x, q_all[start:start + (1 << 14)]).to(torch.float16)
        d = d16.to(torch.float32)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        levels = (torch.clamp(torch.round(x * inv), -8, 7) + 8).to(torch.uint8)
        out.append(torch.cat([d16.view(torch.uint8), levels[:, :16] | (levels[:, 16:] << 4)], dim=1))
    return torch.cat(out).numpy().reshape(-1)


@pytest.mark.parametrize("shape", [(40, 256), (300, 1536), (2, 32 * 16500)])
def test_weighted_search_equals_the_per_chunk_reference(shape):
    rng = np.random.default_rng(shape[0])
    w = _edge_weights(*shape, seed=shape[1]) if shape[0] >= 8 else \
        rng.standard_normal(shape).astype(np.float32)
    imp = (rng.random(shape[1]) ** 4).astype(np.float32)
    imp[32:64] = 0.0
    blocks = ggml.quantize(w, "GGML_Q4_0", importance=imp)
    np.testing.assert_array_equal(blocks, _reference_weighted(w, imp))
    # ordinary Q4_0 bytes: gguf decodes them as circleops does
    with np.errstate(invalid="ignore"):  # inf scale x 0
        deq = gguf.quants.dequantize(blocks.reshape(shape[0], -1), TYPES["GGML_Q4_0"])
    np.testing.assert_array_equal(deq, ggml.dequantize(blocks, "GGML_Q4_0", shape).numpy())
