"""GGML block formats (Q4_0, Q8_0): packing weights, unpacking them, and the Q8_0
quantization onert's kernel applies to a FULLY_CONNECTED input.

Layout (ggml's, and Circle's GGML_Q4_0 / GGML_Q8_0 tensors): rows of 32-element blocks
along the last dimension; a Q8_0 block is fp16 d + 32 int8 (value q*d), a Q4_0 block is
fp16 d + 16 bytes (low nibble element j, high nibble element j+16, value (q-8)*d).
Packing uses the ``gguf`` package (bit-exact with ggml's reference quantizer); unpacking
is done in torch here because it runs on every decode step of the reference interpreter.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from circleops import ir

BLOCK = 32


def _gguf_type(dtype: str) -> Any:
    from gguf import GGMLQuantizationType

    return {"GGML_Q4_0": GGMLQuantizationType.Q4_0, "GGML_Q8_0": GGMLQuantizationType.Q8_0}[dtype]


def quantize(weight: Tensor | np.ndarray, dtype: str) -> np.ndarray:
    """Pack a float [..., K] weight (K % 32 == 0) as ``dtype`` blocks: flat uint8, row by row."""
    from gguf import quants

    w = weight.detach().to(torch.float32).cpu().numpy() if isinstance(weight, Tensor) else \
        np.asarray(weight, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{dtype} needs a last dimension that is a multiple of {BLOCK}, got {list(w.shape)}")
    return quants.quantize(w, _gguf_type(dtype)).reshape(-1)


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
