"""Conv-net ops: torch is NCHW, Circle/TFLite convolutions are NHWC, so each conv is
written TRANSPOSE -> CONV_2D (weights pre-transposed to OHWI at conversion time) ->
TRANSPOSE. 1d convolutions are 2d ones of height 1, 3d ones a CONV_2D over gathered
depth slices, transposed ones TRANSPOSE_CONV. Padding modes use the builtin where the
target runs it (MIRROR_PAD) and an exact GATHER of constant indices elsewhere.
Pooling and resizing are in pool.py and resize.py.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower
from circleops.lowering.shape import pad_rows

aten = torch.ops.aten

_TO_NHWC = (0, 2, 3, 1)
_TO_NCHW = (0, 3, 1, 2)


def _pair(v):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * 2 if len(v) == 1 else v


def _n(v, k):
    v = [int(x) for x in (list(v) if isinstance(v, (list, tuple)) else [v])]
    return v * k if len(v) == 1 else v


def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv2d(ctx, x, weight, bias, stride, padding, dilation, groups):
    """NCHW conv2d (torch semantics) as NHWC CONV_2D / DEPTHWISE_CONV_2D; other groupings
    as one CONV_2D per group."""
    if x.rank == 3:  # unbatched [C, H, W]
        y = conv2d(ctx, ctx.reshape(x, (1,) + x.shape), weight, bias, stride, padding, dilation, groups)
        return ctx.reshape(y, y.shape[1:])
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
    out_h, out_w = _conv_out(h.shape[1], kh, sh, 0, dh), _conv_out(h.shape[2], kw, sw, 0, dw)
    common = dict(padding="VALID", strideW=sw, strideH=sh, dilationWFactor=dw, dilationHFactor=dh,
                  fusedActivationFunction=0)
    if groups == 1:
        y = ctx.emit("CONV_2D", [h, ctx.transpose(weight, _TO_NHWC), bias], "Conv2DOptions",
                     out_shape=(n, out_h, out_w, cout), out_dtype=x.dtype, **common)
    elif groups == cin and cout % cin == 0:
        # depthwise: weight [O, 1, kh, kw] -> [1, kh, kw, O]
        y = ctx.emit("DEPTHWISE_CONV_2D", [h, ctx.transpose(weight, (1, 2, 3, 0)), bias],
                     "DepthwiseConv2DOptions", out_shape=(n, out_h, out_w, cout), out_dtype=x.dtype,
                     depthMultiplier=cout // cin, **common)
    else:
        # grouped: one CONV_2D per group over its channel slice (no runtime here runs a
        # grouped CONV_2D: onert and LiteRT's reference kernel take groups = 1 only)
        ci, co = cin // groups, cout // groups
        parts = [ctx.emit("CONV_2D", [ctx.slice(h, 3, g * ci, (g + 1) * ci),
                                      ctx.transpose(ctx.slice(weight, 0, g * co, (g + 1) * co), _TO_NHWC),
                                      ctx.slice(bias, 0, g * co, (g + 1) * co)], "Conv2DOptions",
                          out_shape=(n, out_h, out_w, co), out_dtype=x.dtype, **common) for g in range(groups)]
        y = ctx.concat(parts, 3)
    return ctx.transpose(y, _TO_NCHW)


def conv3d(ctx, x, weight, bias, stride, padding, dilation, groups):
    """NCDHW conv3d as one CONV_2D: the KD input depth slices each output depth reads are
    gathered into the channels (one GATHER of a constant index table), output depths into
    the batch."""
    if x.rank == 4:  # unbatched [C, D, H, W]
        y = conv3d(ctx, ctx.reshape(x, (1,) + x.shape), weight, bias, stride, padding, dilation, groups)
        return ctx.reshape(y, y.shape[1:])
    (sd, sh, sw), (dd, dh, dw) = _n(stride, 3), _n(dilation, 3)
    kd = weight.shape[2]
    if padding == "same":
        total = [d * (k - 1) for d, k in zip((dd, dh, dw), weight.shape[2:])]
        if any(t % 2 for t in total):  # torch pads the odd one after: do it explicitly
            x = pad(ctx, x, [v for t in reversed(total) for v in (t // 2, t - t // 2)], "constant")
            padding = (0, 0, 0)
        else:
            padding = [t // 2 for t in total]
    elif padding == "valid":
        padding = (0, 0, 0)
    pd, ph, pw = _n(padding, 3)
    if groups > 1:
        ci, co = x.shape[1] // groups, weight.shape[0] // groups
        parts = [conv3d(ctx, ctx.slice(x, 1, g * ci, (g + 1) * ci), ctx.slice(weight, 0, g * co, (g + 1) * co),
                        None if bias is None else ctx.slice(bias, 0, g * co, (g + 1) * co),
                        (sd, sh, sw), (pd, ph, pw), (dd, dh, dw), 1) for g in range(groups)]
        return ctx.concat(parts, 1)
    if pd:
        x = pad(ctx, x, [0, 0, 0, 0, pd, pd], "constant")
    n, c, depth, h, w = x.shape
    out_d = _conv_out(depth, kd, sd, 0, dd)
    index = [o * sd + k * dd for o in range(out_d) for k in range(kd)]
    cols = ctx.gather(ctx.transpose(x, (0, 2, 1, 3, 4)), index, 1)  # [N, Dout·KD, C, H, W]
    cols = ctx.reshape(cols, (n * out_d, kd * c, h, w))
    w2 = ctx.reshape(ctx.transpose(weight, (0, 2, 1, 3, 4)), (weight.shape[0], kd * c) + tuple(weight.shape[3:]))
    y = conv2d(ctx, cols, w2, bias, (sh, sw), (ph, pw), (dh, dw), 1)  # [N·Dout, O, Ho, Wo]
    y = ctx.reshape(y, (n, out_d) + y.shape[1:])
    return ctx.transpose(y, (0, 2, 1, 3, 4))


def conv_transpose2d(ctx, x, weight, bias, stride, padding, output_padding, dilation, groups):
    """NCHW conv_transpose2d as NHWC TRANSPOSE_CONV (VALID: the full output), cropped by
    the padding, extended by output_padding, plus the bias. Dilation dilates the (constant)
    kernel; groups become one TRANSPOSE_CONV per group."""
    if x.rank == 3:
        y = conv_transpose2d(ctx, ctx.reshape(x, (1,) + x.shape), weight, bias, stride, padding, output_padding,
                             dilation, groups)
        return ctx.reshape(y, y.shape[1:])
    if not ctx.supports("TRANSPOSE_CONV", x.dtype):
        return conv_transpose_as_conv(ctx, x, weight, bias, stride, padding, output_padding, dilation, groups)
    (sh, sw), (ph, pw), (oph, opw), (dh, dw) = _n(stride, 2), _n(padding, 2), _n(output_padding, 2), _n(dilation, 2)
    if groups > 1:
        ci, co = x.shape[1] // groups, weight.shape[1]
        parts = [conv_transpose2d(ctx, ctx.slice(x, 1, g * ci, (g + 1) * ci), ctx.slice(weight, 0, g * ci, (g + 1) * ci),
                                  None if bias is None else ctx.slice(bias, 0, g * co, (g + 1) * co),
                                  stride, padding, output_padding, dilation, 1) for g in range(groups)]
        return ctx.concat(parts, 1)
    if (dh > 1 or dw > 1):
        if not weight.is_const:
            raise ctx.unsupported("is a dilated transposed convolution with a non-constant weight",
                                  "Make the weight a parameter or buffer of the model.")
        k = weight.const
        dilated = torch.zeros(k.shape[:2] + (dh * (k.shape[2] - 1) + 1, dw * (k.shape[3] - 1) + 1), dtype=k.dtype)
        dilated[:, :, ::dh, ::dw] = k
        weight = const_value(dilated)
    n, _, h, w = x.shape
    cout, kh, kw = weight.shape[1], weight.shape[2], weight.shape[3]
    full_h, full_w = (h - 1) * sh + kh, (w - 1) * sw + kw
    y = ctx.emit("TRANSPOSE_CONV", [ctx.i32([n, full_h, full_w, cout]), ctx.transpose(weight, (1, 2, 3, 0)),
                                    ctx.transpose(x, _TO_NHWC)], "TransposeConvOptions",
                 out_shape=(n, full_h, full_w, cout), out_dtype=x.dtype, padding="VALID", strideW=sw, strideH=sh)
    out_h, out_w = full_h - 2 * ph + oph, full_w - 2 * pw + opw
    y = ctx.slice(ctx.slice(y, 1, ph, min(full_h, ph + out_h)), 2, pw, min(full_w, pw + out_w))
    if y.shape[1] < out_h or y.shape[2] < out_w:  # output_padding past the full output: zeros
        y = ctx.emit("PAD", [y, const_value(torch.tensor([[0, 0], [0, out_h - y.shape[1]], [0, out_w - y.shape[2]],
                                                          [0, 0]], dtype=torch.int32))],
                     out_shape=(n, out_h, out_w, cout), out_dtype=x.dtype)
    if bias is not None:
        y = ctx.add(y, bias, x.dtype)
    return ctx.transpose(y, _TO_NCHW)


def conv_transpose_as_conv(ctx, x, weight, bias, stride, padding, output_padding, dilation, groups):
    """A transposed convolution (2d or 3d, NC*) as the plain convolution it is: the input
    spread out by the stride (zeros between, one FULLY_CONNECTED per axis), padded by
    d·(k-1) - p (+ output_padding after) and convolved with the flipped, transposed kernel."""
    from circleops.lowering.pool import along

    k = weight.rank - 2
    if x.rank == k + 1:
        y = conv_transpose_as_conv(ctx, ctx.reshape(x, (1,) + x.shape), weight, bias, stride, padding,
                                   output_padding, dilation, groups)
        return ctx.reshape(y, y.shape[1:])
    s, p, op, d = _n(stride, k), _n(padding, k), _n(output_padding, k), _n(dilation, k)
    for axis in range(k):
        if s[axis] > 1:
            size = x.shape[2 + axis]
            spread = torch.zeros((size - 1) * s[axis] + 1, size, dtype=torch.float32)
            spread[torch.arange(size) * s[axis], torch.arange(size)] = 1
            x = along(ctx, x, 2 + axis, spread)
    ks = weight.shape[2:]
    before = [d[a] * (ks[a] - 1) - p[a] for a in range(k)]
    x = pad(ctx, x, [v for a in reversed(range(k)) for v in (before[a], before[a] + op[a])], "constant")
    # [Cin, Cout/g, *k] -> [Cout, Cin/g, *k], spatially flipped
    cin, cog = weight.shape[:2]
    w = ctx.reshape(weight, (groups, cin // groups, cog) + tuple(ks))
    w = ctx.reshape(ctx.transpose(w, (0, 2, 1) + tuple(range(3, 3 + k))), (groups * cog, cin // groups) + tuple(ks))
    w = ctx.call(torch.flip, w, list(range(2, 2 + k)))
    conv = conv2d if k == 2 else conv3d
    return conv(ctx, x, w, bias, [1] * k, [0] * k, d, groups)


def _as_2d(ctx, x, rank):
    """[N, C, L] (or unbatched [C, L]) as [N, C, 1, L]."""
    return ctx.reshape(x, x.shape[:-1] + (1, x.shape[-1]))


def convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution: 1d, 2d and 3d, plain and transposed, batched or not."""
    spatial = weight.rank - 2
    if spatial == 1:  # as 2d with height 1
        w2 = ctx.reshape(weight, weight.shape[:2] + (1, weight.shape[2]))
        pad2 = padding if isinstance(padding, str) else [0] + _n(padding, 1)
        args = ([1] + _n(stride, 1), pad2, [1] + _n(dilation, 1))
        if transposed:
            y = conv_transpose2d(ctx, _as_2d(ctx, x, 1), w2, bias, args[0], args[1], [0] + _n(output_padding, 1),
                                 args[2], groups)
        else:
            y = conv2d(ctx, _as_2d(ctx, x, 1), w2, bias, *args, groups)
        return ctx.reshape(y, y.shape[:-2] + (y.shape[-1],))
    if spatial == 2:
        if transposed:
            return conv_transpose2d(ctx, x, weight, bias, stride, padding, output_padding, dilation, groups)
        return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)
    if spatial == 3:
        if transposed:
            return conv_transpose_as_conv(ctx, x, weight, bias, stride, padding, output_padding, dilation, groups)
        return conv3d(ctx, x, weight, bias, stride, padding, dilation, groups)
    raise ctx.unsupported(f"is a {'transposed ' if transposed else ''}{spatial}d convolution",
                          "Circle and TFLite have no such convolution; use 1d-3d Conv or 1d/2d ConvTranspose.")


@lower(aten.conv1d.default, aten.conv1d.padding, aten.conv3d.default, aten.conv3d.padding)
def _(ctx, node, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return convolution(ctx, x, weight, bias, stride, padding, dilation, False, 0, groups)


@lower(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
def _(ctx, node, x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return convolution(ctx, x, weight, bias, stride, padding, dilation, True, output_padding, groups)


@lower(aten.conv2d.default)
def _(ctx, node, x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)


@lower(aten.conv2d.padding)
def _(ctx, node, x, weight, bias=None, stride=(1, 1), padding="valid", dilation=(1, 1), groups=1):
    return conv2d(ctx, x, weight, bias, stride, padding, dilation, groups)


@lower(aten.convolution.default, aten._convolution.default)
def _(ctx, node, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


# ------------------------------------------------------------------------ padding modes
def _reflect(i, n):
    return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)


_INDEX = {
    "reflect": _reflect,
    "replicate": lambda i, n: min(max(i, 0), n - 1),
    "circular": lambda i, n: i % n,
}


def pad(ctx, x, pad_list, mode, value=0.0):
    rows = pad_rows(x.rank, pad_list)
    negative = any(v < 0 for row in rows for v in row)
    if negative and mode in ("constant", "circular"):
        # a negative pad crops first (PAD refuses it: onert crashes, LiteRT fails at
        # prepare; torch wraps a circular pad around the cropped tensor). Reflect and
        # replicate index the uncropped input: their gather tables below handle it.
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
    if mode == "constant" and not ctx.supports("PAD" if not value else "PADV2", x.dtype, x.rank):
        # one padded dim at a time, as [before, dim, after] (onert pads rank <= 4 only)
        for dim, (a, b) in enumerate(rows):
            if a or b:
                lead, trail = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
                y = pad(ctx, ctx.reshape(x, (lead, x.shape[dim], trail)), [0, 0, a, b], mode, value)
                x = ctx.reshape(y, x.shape[:dim] + (x.shape[dim] + a + b,) + x.shape[dim + 1:])
        return x
    if mode == "constant":
        paddings = const_value(torch.tensor(rows, dtype=torch.int32))
        if not value:
            return ctx.emit("PAD", [x, paddings], **out)
        return ctx.emit("PADV2", [x, paddings, ctx.const(value, x.dtype)], **out)
    if mode not in _INDEX:
        raise ctx.unsupported(f"pads in mode {mode!r}", "Use constant, reflect, replicate or circular padding.")
    if mode == "reflect" and ctx.supports("MIRROR_PAD") and not negative:
        return ctx.emit("MIRROR_PAD", [x, const_value(torch.tensor(rows, dtype=torch.int32))],
                        "MirrorPadOptions", mode="REFLECT", **out)
    # exact everywhere: gather each padded dim with a constant index table
    for dim, (before, after) in enumerate(rows):
        if before or after:
            n = x.shape[dim]
            x = ctx.gather(x, [_INDEX[mode](i, n) for i in range(-before, n + after)], dim)
    return x


@lower(aten.constant_pad_nd)
def _(ctx, node, x, pad_list, value=0):
    return pad(ctx, x, pad_list, "constant", value)


@lower(aten.pad.default)
def _(ctx, node, x, pad_list, mode="constant", value=None):
    return pad(ctx, x, pad_list, mode, value or 0.0)


@lower(aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d)
def _(ctx, node, x, padding):
    return pad(ctx, x, padding, "reflect")


@lower(aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d)
def _(ctx, node, x, padding):
    return pad(ctx, x, padding, "replicate")
