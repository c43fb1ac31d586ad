"""What the integer passes (circleops.quantize.integer.passes) share: the subgraph with its
producer / consumer indices, the integer dtypes' ranges, and the rounding of constants."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from circleops import ir

FLOAT = "FLOAT32"
INTEGER = ("UINT8", "INT8", "INT16", "INT32", "INT64")
RANGE = {"UINT8": (0, 255), "INT8": (-128, 127), "INT16": (-32768, 32767), "INT32": (-(2 ** 31), 2 ** 31 - 1),
         "INT64": (-(2 ** 63), 2 ** 63 - 1),
         "INT4": (-8, 7)}
NP = {"UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "INT4": np.int8}

# ops that only move (or select) values: in and out share parameters; input 0 is the data
PASS_THROUGH = frozenset({
    "RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "STRIDED_SLICE", "SLICE", "GATHER", "PAD", "MIRROR_PAD",
    "MAX_POOL_2D", "SPLIT", "TILE", "BROADCAST_TO", "RESIZE_NEAREST_NEIGHBOR", "REVERSE_V2",
})
# outputs with a known range get TFLite's fixed parameters: dtype -> (scale, zero point)
FIXED_OUTPUT = {
    "LOGISTIC": {"UINT8": (1 / 256, 0), "INT16": (1 / 32768, 0), "INT8": (1 / 256, -128)},
    "SOFTMAX": {"UINT8": (1 / 256, 0), "INT16": (1 / 32768, 0), "INT8": (1 / 256, -128)},
    "TANH": {"UINT8": (1 / 128, 128), "INT16": (1 / 32768, 0), "INT8": (1 / 128, 0)},
}
WEIGHTED = {"FULLY_CONNECTED": 3, "CONV_2D": 3, "DEPTHWISE_CONV_2D": 3}  # (input, filter, bias)


# elements of a constant quantized (or measured) at a time in float64: the Llama-3.2-1B shape's
# 128256 x 2048 embedding and lm_head whole were ~6 float64 copies of 2.1 GB each, and its 16a4w
# convert was OOM-killed lowering them at 24.3 GB on 24 GB (issue 32); elementwise, so the
# same integers block by block
BLOCK_ELEMENTS = 1 << 22


def _row_blocks(shape: tuple, axis: int | None = None) -> list[slice]:
    """Slices along the first axis of blocks of about BLOCK_ELEMENTS elements (the whole
    array when it is a scalar or small)."""
    if not shape or int(np.prod(shape)) <= BLOCK_ELEMENTS:
        return [Ellipsis]
    per_row = max(1, int(np.prod(shape[1:])))
    rows = max(1, BLOCK_ELEMENTS // per_row)
    return [slice(i, min(i + rows, shape[0])) for i in range(0, shape[0], rows)]


def _float64(data: Any) -> np.ndarray:
    return data.detach().to(torch.float64).numpy() if isinstance(data, torch.Tensor) else np.asarray(data, np.float64)


def quantize_array(data: Any, dtype: str, q: ir.QuantParams) -> np.ndarray:
    """round(x / scale) + zero_point, clamped to ``dtype`` (TFLite rounds half away from zero);
    a large constant a block of rows at a time (BLOCK_ELEMENTS)."""
    if isinstance(data, torch.Tensor):
        data = data.detach()
    else:
        data = np.asarray(data)
    shape = tuple(data.shape)
    scale = q.scale.astype(np.float64)
    zp = q.zero_point.astype(np.float64)
    per_row = scale.size > 1 and q.quantized_dimension == 0
    if scale.size > 1:
        sh = [1] * len(shape)
        sh[q.quantized_dimension] = -1
        scale, zp = scale.reshape(sh), zp.reshape(sh)
    lo, hi = RANGE[dtype]

    def block(rows: Any) -> np.ndarray:
        s, z = (scale[rows], zp[rows]) if per_row and rows is not Ellipsis else (scale, zp)
        v = _float64(data[rows]) / s
        return np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5) + z, lo, hi).astype(NP[dtype])

    blocks = _row_blocks(shape)
    if len(blocks) == 1:
        return block(blocks[0])
    out = np.empty(shape, NP[dtype])
    for rows in blocks:
        out[rows] = block(rows)
    return out


def params_from_data(data: Any, dtype: str, per_channel_axis: int | None = None) -> ir.QuantParams:
    """Parameters from a constant's own range (a constant the plan does not know)."""
    data = data.detach() if isinstance(data, torch.Tensor) else np.asarray(data)
    shape = tuple(data.shape)
    if per_channel_axis is not None and shape:
        if per_channel_axis == 0:  # per row: a block of rows at a time
            amax = np.concatenate([np.abs(_float64(data[rows]).reshape(-1 if rows is not Ellipsis else shape[0],
                                                                        int(np.prod(shape[1:])))).max(axis=1)
                                   for rows in _row_blocks(shape)])
        else:
            x = _float64(data)
            amax = np.abs(np.moveaxis(x, per_channel_axis, 0).reshape(x.shape[per_channel_axis], -1)).max(axis=1)
        scale = np.maximum(amax / 127.0, 1e-12).astype(np.float32)
        return ir.QuantParams(scale, np.zeros(scale.size, np.int64), per_channel_axis)
    lo, hi = 0.0, 0.0  # the range over blocks of rows (min and max are exact in any order)
    for rows in _row_blocks(shape):
        x = _float64(data[rows])
        lo, hi = min(float(x.min(initial=0.0)), lo), max(float(x.max(initial=0.0)), hi)
    if dtype == "UINT8":
        scale = max((hi - lo) / 255.0, 1e-12)
        zp = int(np.clip(round(-lo / scale), 0, 255))
    else:
        qmax = {"INT16": 32767, "INT8": 127}[dtype]
        scale, zp = max(max(-lo, hi) / qmax, 1e-12), 0
    return ir.QuantParams(np.array([scale], np.float32), np.array([zp], np.int64), 0)


def same(a: ir.QuantParams | None, b: ir.QuantParams | None) -> bool:
    """Equal quantization parameters (or both None)."""
    if a is None or b is None:
        return a is b
    return (a.scale.shape == b.scale.shape and np.array_equal(a.scale, b.scale)
            and np.array_equal(a.zero_point, b.zero_point) and a.quantized_dimension == b.quantized_dimension)


class Graph:
    """Producer / consumer indices of one subgraph, rebuilt after each structural edit."""

    def __init__(self, sg: ir.Subgraph):
        self.sg = sg
        self.refresh()

    def refresh(self) -> None:
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[tuple[int, int]]] = {}
        for k, op in enumerate(self.sg.operators):
            for o in op.outputs:
                self.producer[o] = k
            for pos, i in enumerate(op.inputs):
                if i >= 0:
                    self.consumers.setdefault(i, []).append((k, pos))

    def tensor(self, i: int) -> ir.Tensor:
        return self.sg.tensors[i]

    def quant(self, i: int) -> bool:
        return self.sg.tensors[i].quant is not None

    def producer_op(self, i: int, opcode: str) -> ir.Operator | None:
        """The op writing tensor ``i`` if it is an ``opcode``."""
        k = self.producer.get(i)
        return self.sg.operators[k] if k is not None and self.sg.operators[k].opcode == opcode else None


def assign(t: ir.Tensor, like: ir.Tensor) -> None:
    """``t`` takes ``like``'s parameters and dtype."""
    t.quant, t.dtype = like.quant, like.dtype


def symmetric16(t: ir.Tensor) -> bool:
    """An int16 tensor with one scale and zero point 0."""
    return t.dtype == "INT16" and t.quant is not None and t.quant.scale.size == 1 and not t.quant.zero_point.any()
