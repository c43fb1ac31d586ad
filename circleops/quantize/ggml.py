"""GGML block formats (Q4_0, Q8_0): packing weights, unpacking them, and the Q8_0
quantization onert's kernel applies to a FULLY_CONNECTED input.

Layout (ggml's, and Circle's GGML_Q4_0 / GGML_Q8_0 tensors): rows of 32-element blocks
along the last dimension; a Q8_0 block is fp16 d + 32 int8 (value q*d), a Q4_0 block is
fp16 d + 16 bytes (low nibble element j, high nibble element j+16, value (q-8)*d).
Packing uses the ``gguf`` package (bit-exact with ggml's reference quantizer), or for Q4_0
with input importances ``quantize_q4_0_weighted`` (the same format, a better choice of each
block's scale); unpacking is done in torch here because it runs on every decode step of the
reference interpreter.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from circleops import ir

BLOCK = 32


def quantize(weight: Tensor | np.ndarray, dtype: str, importance: Tensor | np.ndarray | None = None) -> np.ndarray:
    """Pack a float [..., K] weight (K % 32 == 0) as ``dtype`` blocks: flat uint8, row by row.

    importance: [K] weights of the input channels (Q4_0 only): the blocks then minimise the
    importance-weighted squared error (``quantize_q4_0_weighted``); None: ggml's reference
    max-abs rounding, bit for bit (the bytes of ``gguf.quants.quantize``, computed here in
    torch a cache-sized chunk at a time: 2x faster than gguf's numpy, which matters on
    every weight of a q8_0 convert).
    """
    if importance is not None and dtype == "GGML_Q4_0":
        return quantize_q4_0_weighted(weight, importance)
    w = _float32(weight)
    if w.dim() == 0 or w.shape[-1] % BLOCK:
        raise ValueError(f"{dtype} needs a last dimension that is a multiple of {BLOCK}, got {list(w.shape)}")
    pack = {"GGML_Q4_0": _pack_q4_0_reference, "GGML_Q8_0": _pack_q8_0}.get(dtype)
    if pack is None:
        raise ValueError(f"not a GGML block type: {dtype}")
    x_all = w.reshape(-1, BLOCK)
    out = torch.empty(x_all.shape[0], ir.GGML_BLOCKS[dtype][1], dtype=torch.uint8)
    with one_thread():
        for start in range(0, x_all.shape[0], _CHUNK_BLOCKS):
            pack(x_all[start:start + _CHUNK_BLOCKS], out[start:start + _CHUNK_BLOCKS])
    return out.numpy().reshape(-1)


def _float32(data: Tensor | np.ndarray) -> Tensor:
    """A float32 CPU tensor of ``data`` (no copy when it is one, or a float32 array)."""
    if isinstance(data, Tensor):
        return data.detach().to(torch.float32).cpu()
    arr = np.asarray(data, dtype=np.float32)
    with warnings.catch_warnings():  # read-only arrays (an mmap'd file): only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _pack_q8_0(x: Tensor, out: Tensor) -> None:
    """ggml's quantize_row_q8_0_ref as gguf writes it: d = amax / 127, q = x / d rounded
    half away from zero (gguf's np_roundf), into ``out`` [B, 34]."""
    d = _absmax(x).div_(127.0)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    v = x * inv
    a = v.abs()
    rounded = a.floor()
    # np_roundf's floor + floor(2 (a - floor)): ties away from zero, in float (a bool mask costs 5x)
    rounded.add_(a.sub_(rounded).mul_(2.0).floor_())
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    out[:, 2:] = rounded.copysign_(v).to(torch.int8).view(torch.uint8)


def _pack_q4_0_reference(x: Tensor, out: Tensor) -> None:
    """ggml's quantize_row_q4_0_ref as gguf writes it: d = max / -8 (max: the signed value
    of largest magnitude), q = trunc(x / d + 8.5) clipped to 0..15, into ``out`` [B, 18]."""
    d = _signed_absmax(x).div_(-8.0)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    levels = torch.mul(x, inv).add_(8.5).trunc_().clamp_(0, 15)
    _write_q4_0(levels, d.to(torch.float16), out)


def _write_q4_0(levels: Tensor, d16: Tensor, out: Tensor) -> None:
    """[B, 32] levels 0..15 (float) and [B, 1] fp16 scales as [B, 18] Q4_0 blocks: element j
    in the low nibble of byte j, element j + 16 in its high nibble (the byte computed in
    float and converted once: uint8 shifts cost more than the whole scale search step)."""
    out[:, :2] = d16.view(torch.uint8)
    out[:, 2:] = levels[:, BLOCK // 2:].mul(16).add_(levels[:, :BLOCK // 2])


def _halves(x: Tensor, op: Any) -> Tensor:
    """[B, 1] reduction of [B, 32] rows by pairwise ``op`` (torch.maximum / minimum): exact,
    and 2-3x faster than amax/aminmax over 32-wide rows."""
    n = x.shape[1] // 2
    r = op(x[:, :n], x[:, n:])
    while n > 1:
        n //= 2
        r = op(r[:, :n], r[:, n:2 * n])
    return r


def _absmax(x: Tensor) -> Tensor:
    """[B, 1] max |x| per row."""
    return _halves(x.abs(), torch.maximum)


def _signed_absmax(x: Tensor) -> Tensor:
    """[B, 1] the signed value of largest magnitude per row; of two equal magnitudes of
    opposite sign, the first (as ``x.gather(1, x.abs().argmax(1))`` and numpy's argmax)."""
    hi, lo = _halves(x, torch.maximum), _halves(x, torch.minimum)
    # a row of zeros: its first element, whose sign gives the sign of gguf's d = -0.0 / -8
    mx = torch.where(hi >= -lo, hi, lo)
    mx = torch.where(mx == 0, x[:, :1], mx)
    tie = ((hi == -lo) & (hi != 0)).squeeze(1)
    if bool(tie.any()):  # rare: argmax over those rows only
        rows = tie.nonzero().squeeze(1)
        picked = x[rows]
        mx[rows] = picked.gather(1, picked.abs().argmax(1, keepdim=True))
    return mx


# llama.cpp's make_qx_quants tries the scales -(8 + 0.1 s) / max for s in -9..9; every third
# of them gives the same weighted error on SmolLM2's weights (0.572 vs 0.571 of the reference
# max-abs rounding's) at a third of the time
_SCALE_STEPS = (-0.9, -0.6, -0.3, 0.0, 0.3, 0.6, 0.9)
# blocks per step. Measured on SmolLM2's MLP weights (80M values, idle 2 cores): 16k blocks
# 0.90 s on one worker, 0.57 s on two; 4k 1.05 / 0.78 s; 1k 1.6 / 1.8-2.5 s: every torch op
# takes the GIL, and two workers issuing many small ops wait on each other more than they gain
_CHUNK_BLOCKS = 1 << 14


def quantize_q4_0_weighted(weight: Tensor | np.ndarray, importance: Tensor | np.ndarray) -> np.ndarray:
    """Q4_0 blocks of ``weight`` [N, K] that minimise sum_k importance[k] * (w - w_q)^2 per block.

    ggml's reference Q4_0 maps each block's largest-magnitude value to -8 (d = max / -8). Here,
    as llama.cpp does when it has an importance matrix (make_qx_quants), each block tries the
    roundings of the scales -(8 + s) / max, keeps the one whose least-squares scale leaves the
    smallest weighted error, and rounds again to the stored fp16 scale. importance is the
    mean square of each input channel over calibration text, so what shrinks is the error
    that reaches the output, E[((w - w_q) . x)^2] (its diagonal part). Same format: onert and
    gguf decode it unchanged.
    """
    w = _float32(weight)
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"GGML_Q4_0 needs an [N, K] weight with K a multiple of {BLOCK}, got {list(w.shape)}")
    imp = _float32(importance).reshape(-1)
    if imp.numel() != w.shape[1]:
        raise ValueError(f"importance has {imp.numel()} values for a weight with K={w.shape[1]}")
    # a floor keeps a block whose inputs never fired (importance 0) quantized by magnitude
    imp = imp.clamp_min(max(float(imp.max()), 1e-30) * 1e-6).reshape(-1, BLOCK)
    x_all = w.reshape(-1, BLOCK)
    # whole rows per chunk, so that one [rows * K/32, 32] importance serves every chunk
    # (block b of every row weighs by imp[b]) instead of a copy the size of the weight
    rows = max(1, _CHUNK_BLOCKS // imp.shape[0])
    imp_chunk = imp.repeat(rows, 1)
    step = rows * imp.shape[0]
    out = torch.empty(x_all.shape[0], 2 + BLOCK // 2, dtype=torch.uint8)
    with one_thread():
        for start in range(0, x_all.shape[0], step):
            x = x_all[start:start + step]
            _pack_q4_0(x, _best_scale(x, imp_chunk[:len(x)]), out[start:start + len(x)])
    return out.numpy().reshape(-1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside (restored after). Many small ops (a chunk of
    blocks, a short calibration forward) gain little from a second thread and lose a lot
    when the cores are busy: measured at load average ~11 on 2 cores, 21M weights quantized
    in 1.4 s on one thread and 63 s on two; a 128-token SmolLM2 forward 1.4 s vs 26 s."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def _best_scale(x: Tensor, q: Tensor) -> Tensor:
    """[B, 1] least-squares scales of the best of the candidate roundings (weights q > 0)."""
    mx = _signed_absmax(x)
    mx = torch.where(mx == 0, torch.ones_like(mx), mx)
    t = x / mx
    qx = q * x
    ones = torch.ones(BLOCK, 1)
    levels, prod = torch.empty_like(x), torch.empty_like(x)
    best = torch.full_like(mx, -1.0)
    scale = torch.zeros_like(mx)
    for step in _SCALE_STEPS:
        torch.mul(t, -(8.0 + step), out=levels)
        levels.round_().clamp_(-8, 7)  # the largest value lands on -8 (or -7): suml2 > 0
        # row sums as a matrix-vector product: 2x faster than sum(1) or bmm over 32 columns
        sumlx = torch.mm(torch.mul(qx, levels, out=prod), ones)
        suml2 = torch.mm(torch.mul(levels, levels, out=prod).mul_(q), ones)
        score = sumlx * sumlx / suml2  # the weighted error is sum(q x^2) - score
        better = score > best
        best = torch.where(better, score, best)
        scale = torch.where(better, sumlx / suml2, scale)
    return scale


def _pack_q4_0(x: Tensor, scale: Tensor, out: Tensor) -> None:
    """[B, 32] values at [B, 1] scales as [B, 18] Q4_0 blocks into ``out`` (levels rounded
    half to even at the stored fp16 scale)."""
    d16 = scale.to(torch.float16)
    d = d16.to(torch.float32)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    _write_q4_0(torch.mul(x, inv).round_().clamp_(-8, 7).add_(8), d16, out)


def _as_uint8(blocks: Tensor | np.ndarray) -> Tensor:
    if isinstance(blocks, Tensor):
        return blocks.reshape(-1).view(torch.uint8)
    arr = np.asarray(blocks).reshape(-1)
    with warnings.catch_warnings():  # read-only mmap views: never written to
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr).view(torch.uint8)


def _unpack(b: Tensor, dtype: str) -> Tensor:
    """[n_blocks, block bytes] uint8 -> [n_blocks, 32] float32."""
    d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
    if dtype == "GGML_Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    elif dtype == "GGML_Q4_0":
        qs = b[:, 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32) - 8.0
    else:
        raise ValueError(f"not a GGML block type: {dtype}")
    return q * d


def dequantize_into(blocks: Tensor | np.ndarray, dtype: str, out: Tensor) -> Tensor:
    """The values of packed ``dtype`` blocks written into the contiguous float32 ``out``
    (verify swaps them into the model's own weights: no second copy of each weight)."""
    b = _as_uint8(blocks).reshape(-1, ir.GGML_BLOCKS[dtype][1])
    o = out.view(-1, BLOCK)
    d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
    if dtype == "GGML_Q8_0":
        o.copy_(b[:, 2:].view(torch.int8))
    elif dtype == "GGML_Q4_0":
        qs = b[:, 2:]
        o[:, :BLOCK // 2].copy_(qs & 0x0F)
        o[:, BLOCK // 2:].copy_(qs >> 4)
        o.sub_(8.0)
    else:
        raise ValueError(f"not a GGML block type: {dtype}")
    return o.mul_(d).view(out.shape)


def dequantize(blocks: Tensor | np.ndarray, dtype: str, shape: tuple[int, ...]) -> Tensor:
    """The float32 values of packed ``dtype`` blocks, as a tensor of ``shape``."""
    block_bytes = ir.GGML_BLOCKS[dtype][1]
    b = _as_uint8(blocks).reshape(-1, block_bytes)
    return _unpack(b, dtype).reshape(shape)


def quantize_q8_0_input(x: Tensor) -> Tensor:
    """x through onert's Q8_0 input quantization (ggml's x86 quantize_row_q8_0), as float32.

    Per block of 32: multiplier 127/amax in fp32, round half to even, scale amax/127
    stored as fp16. Onert's GGML FULLY_CONNECTED computes Q8_0(x) . dequant(W).
    """
    shape = x.shape
    xb = x.to(torch.float32).reshape(-1, BLOCK)
    amax = xb.abs().amax(dim=1, keepdim=True)
    mul = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * mul)  # torch.round is half-to-even, as _mm256_round_ps(NEAREST)
    d = (amax / 127.0).to(torch.float16).to(torch.float32)
    return (q * d).reshape(shape)


class BlockTensor:
    """A constant stored as GGML blocks, as the reference interpreter holds it: the packed
    bytes, unpacked on first use (a whole matrix for FULLY_CONNECTED, only the picked rows
    for GATHER)."""

    __slots__ = ("blocks", "dtype", "shape", "_dense")

    def __init__(self, blocks: Tensor | np.ndarray, dtype: str, shape: tuple[int, ...]):
        self.blocks = _as_uint8(blocks)
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self._dense: Tensor | None = None
        want = int(np.prod(self.shape, dtype=np.int64)) // BLOCK * ir.GGML_BLOCKS[dtype][1]
        if not self.shape or self.shape[-1] % BLOCK or self.blocks.numel() != want:
            raise ValueError(f"{dtype} {list(self.shape)} needs {want} bytes of blocks with a last "
                             f"dimension a multiple of {BLOCK}; got {self.blocks.numel()} bytes")

    def dense(self) -> Tensor:
        """All values as float32 (cached: the interpreter reuses a weight every step)."""
        if self._dense is None:
            self._dense = dequantize(self.blocks, self.dtype, self.shape)
        return self._dense

    def rows(self, index: Tensor) -> Tensor:
        """Rows ``index`` (along dimension 0), unpacking only those rows."""
        if self._dense is not None:
            return self._dense.index_select(0, index)
        picked = self.blocks.reshape(self.shape[0], -1).index_select(0, index)
        return dequantize(picked, self.dtype, (len(index), *self.shape[1:]))


# The codec interface of circleops.quantize.formats (the format registry asks these).
encode = quantize
decode = dequantize
decode_into = dequantize_into
