"""Matmul, convolution, pooling and resize kernels (TFLite layouts: NHWC, filters OHWI)."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from circleops import ir
from circleops.quantize.ggml import BlockTensor, quantize_q8_0_input
from circleops.runtime.kernels import (KernelError, activation, check_alloc, enum_value, ints, kernel, option,
                                       same_dtype)

_PADDING = ("SAME", "VALID")


# Products, convolutions and padding size their results from input shapes and options, not
# from the inputs' sizes: [N, 1] x [1, N] from two small tensors, a 2^20-wide pooling window,
# are checked against the allocation limit before torch allocates (check_alloc).

def check_matmul(a_shape: Sequence[int], b_shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
    """Refuse a product of [..., M, K] and [..., K, N] whose [..., M, N] result is over the limit."""
    if len(a_shape) < 2 or len(b_shape) < 2:
        return
    try:
        batch = torch.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    except RuntimeError:
        return  # not broadcastable: torch reports it
    check_alloc([*batch, a_shape[-2], b_shape[-1]], dtype, what)


class Window(NamedTuple):
    """A convolution's or pooling's window: kernel height and width, strides, dilations."""

    kh: int
    kw: int
    sh: int
    sw: int
    dh: int = 1
    dw: int = 1

    @property
    def stride(self) -> tuple[int, int]:
        return self.sh, self.sw

    @property
    def dilation(self) -> tuple[int, int]:
        return self.dh, self.dw


def check_conv(xc: Tensor, window: Window, out_channels: int, dtype: torch.dtype, what: str) -> None:
    """Refuse a convolution of the padded NCHW ``xc`` whose output is over the limit."""
    kh, kw, sh, sw, dh, dw = window
    oh = (xc.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xc.shape[3] - dw * (kw - 1) - 1) // sw + 1
    if oh > 0 and ow > 0:
        check_alloc([xc.shape[0], oh, ow, out_channels], dtype, what)


@kernel("FULLY_CONNECTED")
def _fully_connected(op, inputs, ctx):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    check_alloc([x.numel() // max(w.shape[1], 1), w.shape[0]], x.dtype, "FULLY_CONNECTED")
    if w.dtype == torch.int8 and ctx.inputs and ctx.inputs[1] is not None and ctx.inputs[1].quant is not None:
        return [activation(_hybrid(op, x, w, b, ctx.inputs[1]), op)]
    if isinstance(w, BlockTensor):
        # onert's GGML kernel: the input is quantized to Q8_0 blocks, then dotted with W.
        check_alloc(w.shape, torch.float32, f"dequantized {w.dtype} weight")
        w, x = w.dense(), quantize_q8_0_input(x.reshape(-1, w.shape[1]))
    same_dtype(op, *(t for t in (x, w, b) if t is not None))
    # TFLite flattens the input to [-1, in]; keepNumDims restores the leading dims.
    y = F.linear(x.reshape(-1, w.shape[1]), w, b)
    if option(op, "keepNumDims", default=False):
        y = y.reshape(*x.shape[:-1], w.shape[0])
    return [activation(y, op)]


def _hybrid(op, x: Tensor, w: Tensor, b: Tensor | None, wt: ir.Tensor) -> Tensor:
    """onert's hybrid FULLY_CONNECTED (float x, INT8 w, float out): x quantized per row to
    int8, an integer dot, times the row's scale and the weight's scale[0]
    (circleops.quantize.int8.hybrid_linear). onert reads only scale[0] and ignores zero
    points: other parameters are refused rather than computed one way or the other, except a
    scale per output channel with zero points 0, which only TFLite files hold (LiteRT's
    dynamic-range form; circleops' Circle files never do): computed as LiteRT's XNNPACK does."""
    from circleops.quantize.int8 import dynamic_range_linear, hybrid_linear

    if wt.dtype == "INT4":
        return _int4(op, x, w, b, wt)
    scale, zp = np.asarray(wt.quant.scale).reshape(-1), np.asarray(wt.quant.zero_point).reshape(-1)
    if len(scale) > 1 and len(scale) == w.shape[0] and wt.quant.quantized_dimension == 0 and not np.any(zp != 0):
        # a scale per output channel: TFLite's dynamic-range FULLY_CONNECTED (--quantize w8
        # --target tflite), computed as LiteRT's default XNNPACK delegate does (asymmetric rows)
        y = dynamic_range_linear(x.reshape(-1, w.shape[1]), w, torch.from_numpy(scale.astype(np.float32)), b)
        if option(op, "keepNumDims", default=False):
            y = y.reshape(*x.shape[:-1], w.shape[0])
        return y
    if len(scale) != 1 or np.any(zp != 0):
        raise KernelError(
            f"hybrid FULLY_CONNECTED weight {wt.name!r}: {len(scale)} scales, zero points {zp[:4].tolist()}: onert "
            "uses only scale[0] and ignores zero points, so only one scale and zero point 0 compute the same "
            "everywhere (circleops --quantize w8 writes scale [1.0] and a MUL by the channel scales)")
    y = hybrid_linear(x.reshape(-1, w.shape[1]), w, float(scale[0]), b)
    if option(op, "keepNumDims", default=False):
        y = y.reshape(*x.shape[:-1], w.shape[0])
    return y


def _int4(op, x: Tensor, w: Tensor, b: Tensor | None, wt: ir.Tensor) -> Tensor:
    """LiteRT's XNNPACK FULLY_CONNECTED with an INT4 weight (float x and out): blockwise
    (BlockwiseQuantization, FLOAT16 scales, which XNNPACK rounds to bf16) or one scale per
    output channel with zero points 0 (circleops.quantize.int4.blockwise_linear)."""
    from circleops.quantize.int4 import PER_CHANNEL, blockwise_linear

    blocks = wt.quant.blockwise
    if blocks is not None:
        scales, block = torch.as_tensor(np.asarray(blocks.scales.data, np.float32)), blocks.block_size
        if blocks.scales.quant is not None or blocks.scales.dtype not in ("FLOAT16", "FLOAT32"):
            raise KernelError(f"INT4 FULLY_CONNECTED weight {wt.name!r}: blockwise scales {blocks.scales.dtype} with "
                              "quantization; LiteRT runs float16 block scales (circleops --quantize int4 writes them)")
    else:
        scale, zp = np.asarray(wt.quant.scale).reshape(-1), np.asarray(wt.quant.zero_point).reshape(-1)
        if len(scale) != w.shape[0] or wt.quant.quantized_dimension != 0 or np.any(zp != 0):
            raise KernelError(f"INT4 FULLY_CONNECTED weight {wt.name!r}: {len(scale)} scales along dimension "
                              f"{wt.quant.quantized_dimension} for {w.shape[0]} outputs; LiteRT's XNNPACK runs one scale "
                              "per output channel (zero points 0) or block scales")
        scales, block = torch.from_numpy(scale.astype(np.float32)), PER_CHANNEL
    y = blockwise_linear(x.reshape(-1, w.shape[1]), w, scales, block, b)
    if option(op, "keepNumDims", default=False):
        y = y.reshape(*x.shape[:-1], w.shape[0])
    return y


@kernel("BATCH_MATMUL")
def _batch_matmul(op, inputs, ctx):
    a, b = inputs
    same_dtype(op, a, b)
    if option(op, "adjX", "adjointLhs", default=False):
        a = a.transpose(-1, -2)
    if option(op, "adjY", "adjointRhs", default=False):
        b = b.transpose(-1, -2)
    check_matmul(a.shape, b.shape, a.dtype, "BATCH_MATMUL")
    return [torch.matmul(a, b)]


def _same_pad(size: int, kernel_size: int, stride: int, dilation: int) -> tuple[int, int]:
    # TensorFlow SAME: output = ceil(size / stride); the odd pixel of padding goes after.
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel_size - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def pad_nchw(x: Tensor, op, window: Window, value: float = 0.0) -> Tensor:
    """``x`` (NCHW) padded as the op's SAME/VALID padding says for ``window``."""
    if enum_value(option(op, "padding", default=0), _PADDING) == 1:  # VALID
        return x
    kh, kw, sh, sw, dh, dw = window
    top, bottom = _same_pad(x.shape[2], kh, sh, dh)
    left, right = _same_pad(x.shape[3], kw, sw, dw)
    if top or bottom or left or right:
        check_alloc([*x.shape[:2], x.shape[2] + top + bottom, x.shape[3] + left + right], x.dtype,
                    f"SAME padding of {op.opcode} (window {kh}x{kw}, dilation {dh}x{dw})")
        x = F.pad(x, (left, right, top, bottom), value=value)
    return x


def conv_strides(op) -> tuple[int, int, int, int]:
    """(strideH, strideW, dilationH, dilationW) of a CONV_2D / DEPTHWISE_CONV_2D / pool op."""
    return (int(option(op, "strideH", default=1) or 1), int(option(op, "strideW", default=1) or 1),
            int(option(op, "dilationHFactor", default=1) or 1), int(option(op, "dilationWFactor", default=1) or 1))


def conv_window(op, w: Tensor) -> Window:
    """The window of a CONV_2D / DEPTHWISE_CONV_2D whose filter is ``w`` ([O or 1, KH, KW, I])."""
    return Window(w.shape[1], w.shape[2], *conv_strides(op))


def conv_layout(x: Tensor, w: Tensor, depthwise: bool) -> tuple[Tensor, int, int]:
    """(the filter in torch's [O, I / groups, KH, KW] layout, groups, output channels) of a
    CONV_2D (filter OHWI with I = C / groups) or DEPTHWISE_CONV_2D (filter [1, KH, KW, C·M]:
    output channel c·M + m reads input channel c, torch's grouped-conv order with groups = C)."""
    if depthwise:
        return w.permute(3, 0, 1, 2), x.shape[3], w.shape[3]
    return w.permute(0, 3, 1, 2), x.shape[3] // w.shape[3], w.shape[0]


def _conv(op, inputs, depthwise: bool):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if isinstance(w, BlockTensor):
        # onert's GGML kernel: the input is quantized to Q8_0 blocks, then dotted with W.
        w, x = w.dense(), quantize_q8_0_input(x.reshape(-1, w.shape[1]))
    same_dtype(op, *(t for t in (x, w, b) if t is not None))
    window = conv_window(op, w)
    filters, groups, out_channels = conv_layout(x, w, depthwise)
    xc = pad_nchw(x.permute(0, 3, 1, 2), op, window)
    check_conv(xc, window, out_channels, x.dtype, op.opcode)
    y = F.conv2d(xc, filters, b, stride=window.stride, dilation=window.dilation, groups=groups)
    return [activation(y.permute(0, 2, 3, 1), op)]


@kernel("CONV_2D")
def _conv_2d(op, inputs, ctx):
    return _conv(op, inputs, depthwise=False)


@kernel("DEPTHWISE_CONV_2D")
def _depthwise_conv_2d(op, inputs, ctx):
    return _conv(op, inputs, depthwise=True)


@kernel("TRANSPOSE_CONV")
def _transpose_conv(op, inputs, ctx):
    out_shape_t, w, x = inputs[0], inputs[1], inputs[2]
    b = inputs[3] if len(inputs) > 3 else None
    same_dtype(op, *(t for t in (x, w, b) if t is not None))
    sh, sw = int(option(op, "strideH", default=1)), int(option(op, "strideW", default=1))
    n, oh, ow, oc = ints(out_shape_t)
    check_alloc([n, oh, ow, oc], x.dtype, "TRANSPOSE_CONV")
    check_alloc([x.shape[0], w.shape[0], (x.shape[1] - 1) * sh + w.shape[1], (x.shape[2] - 1) * sw + w.shape[2]],
                x.dtype, "TRANSPOSE_CONV")
    # filter [O, KH, KW, I] -> torch [I, O, KH, KW]; the full result is cropped to the
    # requested output with TFLite's padding (computed with input and output swapped).
    y = F.conv_transpose2d(x.permute(0, 3, 1, 2), w.permute(3, 0, 1, 2), None, stride=(sh, sw))
    top = left = 0
    if enum_value(option(op, "padding", default=0), _PADDING) == 0:
        top = max((x.shape[1] - 1) * sh + w.shape[1] - oh, 0) // 2
        left = max((x.shape[2] - 1) * sw + w.shape[2] - ow, 0) // 2
    y = y[:, :, top:top + oh, left:left + ow]
    if y.shape[2] != oh or y.shape[3] != ow:
        y = F.pad(y, (0, ow - y.shape[3], 0, oh - y.shape[2]))
    y = y.permute(0, 2, 3, 1)
    if b is not None:
        y = y + b
    return [activation(y, op)]


def _pool_window(op) -> Window:
    return Window(int(option(op, "filterHeight", default=1)), int(option(op, "filterWidth", default=1)),
                  int(option(op, "strideH", default=1)), int(option(op, "strideW", default=1)))


@kernel("MAX_POOL_2D")
def _max_pool_2d(op, inputs, ctx):
    window = _pool_window(op)
    xc = pad_nchw(inputs[0].permute(0, 3, 1, 2), op, window, value=-math.inf)
    return [activation(F.max_pool2d(xc, window[:2], window.stride).permute(0, 2, 3, 1), op)]


@kernel("AVERAGE_POOL_2D")
def _average_pool_2d(op, inputs, ctx):
    window = _pool_window(op)
    x = inputs[0].permute(0, 3, 1, 2)
    # TFLite averages over the valid pixels only: divide window sums by window counts.
    total = F.avg_pool2d(pad_nchw(x, op, window), window[:2], window.stride, divisor_override=1)
    ones = torch.ones((1, 1, x.shape[2], x.shape[3]), dtype=x.dtype)
    count = F.avg_pool2d(pad_nchw(ones, op, window), window[:2], window.stride, divisor_override=1)
    return [activation((total / count).permute(0, 2, 3, 1), op)]


def _resize_args(op, inputs) -> tuple[Tensor, int, int, bool, bool]:
    """(x, output height, output width, alignCorners, halfPixelCenters) of a RESIZE_* op."""
    size = ints(inputs[1])
    if len(size) != 2:
        raise KernelError(f"resize size must have 2 values, got {size}")
    check_alloc([inputs[0].shape[0], size[0], size[1], inputs[0].shape[-1]], inputs[0].dtype, "resize")
    return (inputs[0], size[0], size[1], bool(option(op, "alignCorners", default=False)),
            bool(option(op, "halfPixelCenters", default=False)))


def _nearest_index(out_size: int, in_size: int, align: bool, half: bool) -> Tensor:
    # TFLite's GetNearestNeighbor, in float32 as the C++ kernel computes it.
    scale = (in_size - 1) / (out_size - 1) if align and out_size > 1 else in_size / out_size
    scale_t = torch.tensor(scale, dtype=torch.float32)
    pos = (torch.arange(out_size, dtype=torch.float32) + (0.5 if half else 0.0)) * scale_t
    # TfLiteRound rounds half away from zero.
    idx = (torch.sign(pos) * torch.floor(pos.abs() + 0.5)) if align else torch.floor(pos)
    idx = idx.to(torch.long).clamp(max=in_size - 1)
    return idx.clamp(min=0) if half else idx


@kernel("RESIZE_NEAREST_NEIGHBOR")
def _resize_nearest(op, inputs, ctx):
    x, oh, ow, align, half = _resize_args(op, inputs)
    x = x.index_select(1, _nearest_index(oh, x.shape[1], align, half))
    return [x.index_select(2, _nearest_index(ow, x.shape[2], align, half))]


def _bilinear_weights(out_size: int, in_size: int, align: bool, half: bool):
    scale = (in_size - 1) / (out_size - 1) if align and out_size > 1 else in_size / out_size
    v = torch.arange(out_size, dtype=torch.float32)
    scaled = (v + 0.5) * scale - 0.5 if half else v * scale
    lower = torch.floor(scaled).to(torch.long).clamp(min=0)
    upper = torch.ceil(scaled).to(torch.long).clamp(max=in_size - 1)
    return lower, upper, scaled - lower.to(torch.float32)


@kernel("RESIZE_BILINEAR")
def _resize_bilinear(op, inputs, ctx):
    x, oh, ow, align, half = _resize_args(op, inputs)
    y0, y1, fy = _bilinear_weights(oh, x.shape[1], align, half)
    x0, x1, fx = _bilinear_weights(ow, x.shape[2], align, half)
    fy = fy.to(x.dtype).reshape(1, -1, 1, 1)
    fx = fx.to(x.dtype).reshape(1, 1, -1, 1)
    top = x.index_select(1, y0)
    bottom = x.index_select(1, y1)
    tl, tr = top.index_select(2, x0), top.index_select(2, x1)
    bl, br = bottom.index_select(2, x0), bottom.index_select(2, x1)
    return [tl * (1 - fy) * (1 - fx) + tr * (1 - fy) * fx + bl * fy * (1 - fx) + br * fy * fx]
