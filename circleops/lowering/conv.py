"""Conv-net ops: torch is NCHW, Circle/TFLite convolutions are NHWC, so each conv is
written TRANSPOSE -> CONV_2D (weights pre-transposed to OHWI at conversion time) ->
TRANSPOSE. Padding modes and nearest upsampling use the builtin where the target runs it
(MIRROR_PAD, RESIZE_NEAREST_NEIGHBOR) and an exact GATHER of constant indices elsewhere.
"""
from __future__ import annotations

import numpy as np
import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower
from circleops.lowering.shape import _paddings

aten = torch.ops.aten

_TO_NHWC = (0, 2, 3, 1)
_TO_NCHW = (0, 3, 1, 2)


def _pair(v):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * 2 if len(v) == 1 else v


def conv2d(ctx, x, weight, bias, stride, padding, dilation, groups):
    """NCHW conv2d (torch semantics) as NHWC CONV_2D / DEPTHWISE_CONV_2D."""
    n, cin = x.shape[:2]
    cout = weight.shape[0]
    (sh, sw), (dh, dw) = _pair(stride), _pair(dilation)
    h = ctx.transpose(x, _TO_NHWC)
    kh, kw = weight.shape[2:]
    if padding == "same":  # torch: total d·(k-1), the odd one on the right/bottom
        rows = [[d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2] for d, k in ((dh, kh), (dw, kw))]
    else:
        rows = [[p, p] for p in _pair((0, 0) if padding == "valid" else padding)]
    if any(v for row in rows for v in row):
        (t, b), (l, r) = rows
        h = ctx.emit("PAD", [h, const_value(torch.tensor([[0, 0], [t, b], [l, r], [0, 0]], dtype=torch.int32))],
                     out_shape=(n, h.shape[1] + t + b, h.shape[2] + l + r, cin), out_dtype=x.dtype)
    if bias is None:
        bias = ctx.const(torch.zeros(cout, dtype=x.dtype))
    out_n, _, out_h, out_w = ctx.out_shape
    common = dict(padding="VALID", strideW=sw, strideH=sh, dilationWFactor=dw, dilationHFactor=dh,
                  fusedActivationFunction=0)
    if groups == 1:
        y = ctx.emit("CONV_2D", [h, ctx.transpose(weight, _TO_NHWC), bias], "Conv2DOptions",
                     out_shape=(out_n, out_h, out_w, cout), **common)
    elif groups == cin and cout % cin == 0:
        # depthwise: weight [O, 1, kh, kw] -> [1, kh, kw, O]
        y = ctx.emit("DEPTHWISE_CONV_2D", [h, ctx.transpose(weight, (1, 2, 3, 0)), bias],
                     "DepthwiseConv2DOptions", out_shape=(out_n, out_h, out_w, cout),
                     depthMultiplier=cout // cin, **common)
    else:
        raise ctx.unsupported(f"is a grouped convolution (groups={groups})",
                              "Only groups=1 and depthwise convolutions are supported.")
    return ctx.transpose(y, _TO_NCHW)


@lower(aten.conv2d.default)
def _(ctx, node, x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)


@lower(aten.conv2d.padding)
def _(ctx, node, x, weight, bias=None, stride=(1, 1), padding="valid", dilation=(1, 1), groups=1):
    return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)


@lower(aten.convolution.default, aten._convolution.default)
def _(ctx, node, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *rest):
    if transposed or x.rank != 4:
        raise ctx.unsupported("is a transposed or non-2D convolution",
                              "Use Conv2d (or upsample + Conv2d instead of ConvTranspose2d).")
    return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)


# ------------------------------------------------------------------------ padding modes
def _reflect(i, n):
    return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)


_INDEX = {
    "reflect": _reflect,
    "replicate": lambda i, n: min(max(i, 0), n - 1),
    "circular": lambda i, n: i % n,
}


def pad(ctx, x, pad_list, mode, value=0.0):
    rows = _paddings(x.rank, pad_list)
    if mode == "constant" and any(v < 0 for row in rows for v in row):
        # a negative pad crops (PAD refuses it: onert crashes, LiteRT fails at prepare)
        for dim, (before, after) in enumerate(rows):
            if before < 0 or after < 0:
                x = ctx.slice(x, dim, max(-before, 0), x.shape[dim] - max(-after, 0))
        rows = [[max(v, 0) for v in row] for row in rows]
        pad_list = [v for row in reversed(rows) for v in row]
        if not any(pad_list):
            return x
    t = ctx.transposed(x)
    if t is not None:  # pad the channels-last source instead: the transposes then cancel
        src, perm = t
        src_rows = [None] * x.rank
        for i, p in enumerate(perm):
            src_rows[p] = rows[i]
        flat = [v for row in reversed(src_rows) for v in row]
        return ctx.transpose(pad(ctx, src, flat, mode, value), perm)
    out = dict(out_shape=[d + a + b for d, (a, b) in zip(x.shape, rows)], out_dtype=x.dtype)
    if mode == "constant":
        paddings = const_value(torch.tensor(rows, dtype=torch.int32))
        if not value:
            return ctx.emit("PAD", [x, paddings], **out)
        return ctx.emit("PADV2", [x, paddings, ctx.const(value, x.dtype)], **out)
    if mode not in _INDEX:
        raise ctx.unsupported(f"pads in mode {mode!r}", "Use constant, reflect, replicate or circular padding.")
    if mode == "reflect" and ctx.supports("MIRROR_PAD"):
        return ctx.emit("MIRROR_PAD", [x, const_value(torch.tensor(rows, dtype=torch.int32))],
                        "MirrorPadOptions", mode="REFLECT", **out)
    # exact everywhere: gather each padded dim with a constant index table
    for dim, (before, after) in enumerate(rows):
        if before or after:
            n = x.shape[dim]
            x = ctx.gather(x, [_INDEX[mode](i, n) for i in range(-before, n + after)], dim)
    return x


@lower(aten.pad.default)
def _(ctx, node, x, pad_list, mode="constant", value=None):
    return pad(ctx, x, pad_list, mode, value or 0.0)


@lower(aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d)
def _(ctx, node, x, padding):
    return pad(ctx, x, padding, "reflect")


@lower(aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d)
def _(ctx, node, x, padding):
    return pad(ctx, x, padding, "replicate")


# ------------------------------------------------------------------------ nearest upsampling
def _nearest_index(n_in, n_out, scale):
    """torch's nearest source index: min(floor(dst · scale), n_in - 1), in float32."""
    s = np.float32(n_in / n_out) if scale is None else np.float32(1.0 / scale)
    return [min(int(np.floor(np.float32(j) * s)), n_in - 1) for j in range(n_out)]


def upsample_nearest2d(ctx, x, scales):
    (n, c, h, w), (_, _, oh, ow) = x.shape, ctx.out_shape
    sh, sw = scales if scales else (None, None)
    rows, cols = _nearest_index(h, oh, sh), _nearest_index(w, ow, sw)
    if ctx.supports("RESIZE_NEAREST_NEIGHBOR") and rows == _nearest_index(h, oh, None) \
            and cols == _nearest_index(w, ow, None):
        y = ctx.emit("RESIZE_NEAREST_NEIGHBOR", [ctx.transpose(x, _TO_NHWC), ctx.i32([oh, ow])],
                     "ResizeNearestNeighborOptions", out_shape=(n, oh, ow, c),
                     alignCorners=False, halfPixelCenters=False)
        return ctx.transpose(y, _TO_NCHW)
    return ctx.gather(ctx.gather(x, rows, 2), cols, 3)


@lower(aten.upsample_nearest2d.vec)
def _(ctx, node, x, output_size, scale_factors):
    return upsample_nearest2d(ctx, x, None if output_size is not None else scale_factors)


@lower(aten.upsample_nearest2d.default)
def _(ctx, node, x, output_size, scales_h=None, scales_w=None):
    return upsample_nearest2d(ctx, x, None if scales_h is None else (scales_h, scales_w))


# ------------------------------------------------------------------------ pooling
def _pool(ctx, opcode, x, kernel, stride, padding):
    (kh, kw), (ph, pw) = _pair(kernel), _pair(padding)
    (sh, sw) = _pair(stride) if stride else (kh, kw)
    if ph or pw:
        raise ctx.unsupported("pools with implicit padding", "Pad explicitly (nn.ZeroPad2d) before pooling.")
    n, c = x.shape[:2]
    _, _, oh, ow = ctx.out_shape
    y = ctx.emit(opcode, [ctx.transpose(x, _TO_NHWC)], "Pool2DOptions", out_shape=(n, oh, ow, c),
                 padding="VALID", strideW=sw, strideH=sh, filterWidth=kw, filterHeight=kh,
                 fusedActivationFunction=0)
    return ctx.transpose(y, _TO_NCHW)


@lower(aten.max_pool2d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _pool(ctx, "MAX_POOL_2D", x, kernel_size, stride, padding)


@lower(aten.avg_pool2d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _pool(ctx, "AVERAGE_POOL_2D", x, kernel_size, stride, padding)


@lower(aten.adaptive_avg_pool2d)
def _(ctx, node, x, output_size):
    if tuple(_pair(output_size)) != (1, 1):
        raise ctx.unsupported(f"adaptively pools to {output_size}", "Only output size 1x1 is supported.")
    return ctx.emit("MEAN", [x, ctx.i32([2, 3])], "ReducerOptions", keepDims=True)
