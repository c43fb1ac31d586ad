"""Pooling and resizing: torch NCHW (and 1d / 3d) semantics on NHWC builtins.

* max / average pooling with any padding, ceil_mode, count_include_pad, divisor_override
  and (max) dilation: the input is padded explicitly (-inf or 0), pooled VALID, and an
  average is rescaled by a constant map where torch's divisor differs from the window's size.
  1d pools are 2d pools of height 1; 3d pools are separable (a 2d pool over H, W, then
  one over D).
* adaptive pools and every interpolate mode: separable per spatial axis. An average or an
  interpolation along one axis is a constant matrix, computed by running the torch op
  itself on a one-hot basis, applied as FULLY_CONNECTED (exact where torch is linear);
  an adaptive max is a REDUCE_MAX per bin. RESIZE_BILINEAR / RESIZE_NEAREST_NEIGHBOR are
  written instead where their semantics are torch's and the target runs them.
"""
from __future__ import annotations

import math
import operator

import numpy as np
import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower

aten = torch.ops.aten
_TO_NHWC = (0, 2, 3, 1)
_TO_NCHW = (0, 3, 1, 2)


def _n(v, k):
    """An int or a sequence as a list of k ints (torch's _pair / _triple)."""
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in (v * k if len(v) == 1 else v)]


def _out_size(size, k, s, p, d, ceil):
    """torch's pooling output size (pooling_output_shape)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _avg_divisor(size, k, s, p, out, include_pad):
    """torch's avg_pool divisor per output position along one axis."""
    div = []
    for o in range(out):
        start = o * s - p
        end = min(start + k, size + p)
        n = end - start
        if not include_pad:
            n = min(end, size) - max(start, 0)
        div.append(n)
    return np.array(div, dtype=np.float64)


def pool2d(ctx, kind, x, kernel, stride, padding, dilation=1, ceil=False, include_pad=True, divisor=None,
           indices=False):
    """NCHW max ("max") or average ("avg") pooling with torch's full semantics; with
    ``indices`` (max only), (values, int64 argmax indices into each H·W plane)."""
    (kh, kw), (ph, pw), (dh, dw) = _n(kernel, 2), _n(padding, 2), _n(dilation, 2)
    sh, sw = _n(stride, 2) if stride else (kh, kw)
    n, c, h, w = x.shape
    oh, ow = _out_size(h, kh, sh, ph, dh, ceil), _out_size(w, kw, sw, pw, dw, ceil)
    # pad so that every window lies inside: torch's padding, plus ceil_mode's extra on the end
    eh = max((oh - 1) * sh + dh * (kh - 1) + 1 - (h + 2 * ph), 0)
    ew = max((ow - 1) * sw + dw * (kw - 1) + 1 - (w + 2 * pw), 0)
    y = ctx.transpose(x, _TO_NHWC)
    if ph or pw or eh or ew:
        rows = torch.tensor([[0, 0], [ph, ph + eh], [pw, pw + ew], [0, 0]], dtype=torch.int32)
        shape = (n, h + 2 * ph + eh, w + 2 * pw + ew, c)
        if kind == "max":
            y = ctx.emit("PADV2", [y, const_value(rows), ctx.const(-math.inf, x.dtype)], out_shape=shape, out_dtype=x.dtype)
        else:
            y = ctx.emit("PAD", [y, const_value(rows)], out_shape=shape, out_dtype=x.dtype)
    out = (n, oh, ow, c)
    if kind == "max" and (dh > 1 or dw > 1 or indices):
        # the max over the kh·kw strided slices, one per window tap (dilated windows, and
        # argmax indices: the flat h·W + w of the first maximum, as torch)
        best = index = None
        for i in range(kh):
            for j in range(kw):
                begin, end = [0, i * dh, j * dw, 0], [n, i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1, c]
                tap = ctx.emit("STRIDED_SLICE", [y, ctx.i32(begin), ctx.i32(end), ctx.i32([1, sh, sw, 1])],
                               "StridedSliceOptions", out_shape=out, out_dtype=x.dtype)
                rows = torch.arange(oh) * sh + i * dh - ph
                cols = torch.arange(ow) * sw + j * dw - pw
                where = const_value((rows[:, None] * w + cols[None, :]).to(torch.float32).reshape(1, oh, ow, 1))
                if best is None:
                    best, index = tap, where
                    continue
                if indices:  # float32 positions: exact below 2**24, and every runtime selects floats
                    better = ctx.cast(ctx.binary("GREATER", tap, best, out_dtype=torch.bool), torch.float32)
                    index = ctx.add(index, ctx.mul(ctx.sub(where, index), better))
                best = ctx.binary("MAXIMUM", best, tap, dtype=x.dtype)
        y = ctx.transpose(best, _TO_NCHW)
        if indices:
            if index.is_const:
                index = const_value(index.const.expand(out).contiguous())
            return y, ctx.cast(ctx.transpose(index, _TO_NCHW), torch.int64)
        return y
    opcode = "MAX_POOL_2D" if kind == "max" else "AVERAGE_POOL_2D"
    y = ctx.emit(opcode, [y], "Pool2DOptions", out_shape=out, out_dtype=x.dtype, padding="VALID", strideW=sw,
                 strideH=sh, filterWidth=kw, filterHeight=kh, fusedActivationFunction=0)
    if kind == "avg":
        # AVERAGE_POOL_2D divided by kh·kw; torch divides by its own divisor
        if divisor:
            scale = np.full((oh, ow), kh * kw / divisor)
        else:
            scale = kh * kw / np.outer(_avg_divisor(h, kh, sh, ph, oh, include_pad),
                                       _avg_divisor(w, kw, sw, pw, ow, include_pad))
        if not np.allclose(scale, 1.0, rtol=0, atol=0):
            y = ctx.mul(y, const_value(torch.from_numpy(scale.reshape(1, oh, ow, 1)).to(x.dtype)), x.dtype)
    return ctx.transpose(y, _TO_NCHW)


def pool(ctx, kind, x, dims, kernel, stride, padding, dilation=1, ceil=False, include_pad=True, divisor=None):
    """A ``dims``-d pool (1, 2 or 3) of x [N, C, *spatial] or unbatched [C, *spatial]."""
    if x.rank == dims + 1:
        y = pool(ctx, kind, ctx.reshape(x, (1,) + x.shape), dims, kernel, stride, padding, dilation, ceil,
                 include_pad, divisor)
        return ctx.reshape(y, y.shape[1:])
    k, p, d = _n(kernel, dims), _n(padding, dims), _n(dilation, dims)
    s = _n(stride, dims) if stride else k
    if dims == 2:
        return pool2d(ctx, kind, x, k, s, p, d, ceil, include_pad, divisor)
    if dims == 1:
        y = pool2d(ctx, kind, ctx.reshape(x, x.shape[:2] + (1, x.shape[2])), (1, k[0]), (1, s[0]), (0, p[0]),
                   (1, d[0]), ceil, include_pad, divisor)
        return ctx.reshape(y, y.shape[:2] + (y.shape[3],))
    # 3d: separable. An override divisor is applied once, after two window sums.
    n, c, dd, h, w = x.shape
    sums = 1 if divisor else None
    y = pool2d(ctx, kind, ctx.reshape(x, (n, c * dd, h, w)), k[1:], s[1:], p[1:], d[1:], ceil, include_pad, sums)
    oh, ow = y.shape[2:]
    y = pool2d(ctx, kind, ctx.reshape(y, (n, c, dd, oh * ow)), (k[0], 1), (s[0], 1), (p[0], 0), (d[0], 1), ceil,
               include_pad, sums)
    y = ctx.reshape(y, (n, c, y.shape[2], oh, ow))
    return ctx.div(y, float(divisor), x.dtype) if divisor else y


def _max_with_indices(ctx, node, dims, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    if not any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
        return [pool(ctx, "max", x, dims, kernel, stride, padding, dilation, ceil_mode), None]
    if dims == 3:
        raise ctx.unsupported("reads the indices of a 3d max pooling (return_indices=True)",
                              "Pool without return_indices (1d and 2d pools return them).")
    unbatched = x.rank == dims + 1
    h = ctx.reshape(x, (1,) + x.shape) if unbatched else x
    k, s, p, d = _n(kernel, dims), _n(stride, dims) if stride else _n(kernel, dims), _n(padding, dims), _n(dilation, dims)
    if dims == 1:
        h = ctx.reshape(h, h.shape[:2] + (1, h.shape[2]))
        k, s, p, d = [1] + k, [1] + s, [0] + p, [1] + d
    y, index = pool2d(ctx, "max", h, k, s, p, d, ceil_mode, indices=True)
    shape = (tuple(x.shape[:-dims]) + tuple(y.shape[-dims:])) if dims == 2 else (tuple(x.shape[:-1]) + (y.shape[-1],))
    return [ctx.reshape(y, shape), ctx.reshape(index, shape)]


@lower(aten.max_pool1d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return pool(ctx, "max", x, 1, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool2d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return pool(ctx, "max", x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool3d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return pool(ctx, "max", x, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool1d_with_indices)
def _(ctx, node, *args, **kwargs):
    return _max_with_indices(ctx, node, 1, *args, **kwargs)


@lower(aten.max_pool2d_with_indices)
def _(ctx, node, *args, **kwargs):
    return _max_with_indices(ctx, node, 2, *args, **kwargs)


@lower(aten.max_pool3d_with_indices)
def _(ctx, node, *args, **kwargs):
    return _max_with_indices(ctx, node, 3, *args, **kwargs)


@lower(aten.avg_pool1d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    return pool(ctx, "avg", x, 1, kernel_size, stride, padding, 1, ceil_mode, count_include_pad)


@lower(aten.avg_pool2d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return pool(ctx, "avg", x, 2, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool3d)
def _(ctx, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return pool(ctx, "avg", x, 3, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, divisor_override)


# ------------------------------------------------------------------------ separable axis maps
def along(ctx, x, axis, matrix):
    """x with axis ``axis`` replaced by matrix [out, in] · x (a FULLY_CONNECTED over it)."""
    axis %= x.rank
    out, size = matrix.shape
    if out == size and torch.equal(matrix, torch.eye(size, dtype=matrix.dtype)):
        return x
    perm = [d for d in range(x.rank) if d != axis] + [axis]
    h = ctx.transpose(x, perm)
    flat = ctx.reshape(h, (-1, size))
    y = ctx.emit("FULLY_CONNECTED", [flat, const_value(matrix.to(x.dtype).contiguous()), None], "FullyConnectedOptions",
                 out_shape=(flat.shape[0], out), out_dtype=x.dtype, fusedActivationFunction=0, keepNumDims=False)
    y = ctx.reshape(y, h.shape[:-1] + (out,))
    return ctx.transpose(y, [perm.index(d) for d in range(x.rank)])


def axis_matrices(op, in_sizes, out_sizes, make_args):
    """The constant [out, in] matrix per spatial axis of a separable linear op, computed by
    running ``op`` on a one-hot basis along that axis (size 1 along the others):
    ``make_args(axis, sizes)`` gives op's arguments after the input for those sizes."""
    mats = []
    k = len(in_sizes)
    for axis, (n_in, n_out) in enumerate(zip(in_sizes, out_sizes)):
        shape = [n_in, 1] + [n_in if a == axis else 1 for a in range(k)]
        basis = torch.eye(n_in, dtype=torch.float64).reshape(shape)
        sizes = [n_out if a == axis else 1 for a in range(k)]
        y = op(basis, *make_args(axis, sizes))
        mats.append(y.reshape(n_in, n_out).t().to(torch.float32))
    return mats


def separable(ctx, x, op, in_sizes, out_sizes, make_args):
    """x [N, C, *spatial] through a separable linear op, one FULLY_CONNECTED per axis."""
    k = len(in_sizes)
    if x.rank == k + 1:  # unbatched
        y = separable(ctx, ctx.reshape(x, (1,) + x.shape), op, in_sizes, out_sizes, make_args)
        return ctx.reshape(y, y.shape[1:])
    for axis, m in enumerate(axis_matrices(op, in_sizes, out_sizes, make_args)):
        x = along(ctx, x, 2 + axis, m)
    return x


# ------------------------------------------------------------------------ adaptive pools
def _adaptive_bins(size, out):
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


def adaptive_avg(ctx, x, output_size, k):
    spatial = x.shape[-k:]
    out = [s if o is None else int(o) for s, o in zip(spatial, _n(output_size, k))]
    if all(s % o == 0 for s, o in zip(spatial, out)) and k <= 3:
        kernel = [s // o for s, o in zip(spatial, out)]
        if all(o == 1 for o in out) and x.rank == k + 2:  # global pooling: one MEAN
            return ctx.emit("MEAN", [x, ctx.i32(list(range(2, 2 + k)))], "ReducerOptions",
                            out_shape=x.shape[:2] + (1,) * k, out_dtype=x.dtype, keepDims=True)
        return pool(ctx, "avg", x, k, kernel, kernel, 0)
    op = {1: aten.adaptive_avg_pool1d, 2: aten._adaptive_avg_pool2d, 3: aten._adaptive_avg_pool3d}[k]
    return separable(ctx, x, op, spatial, out, lambda axis, sizes: (sizes,))


def adaptive_max(ctx, x, output_size, k):
    spatial = x.shape[-k:]
    out = [s if o is None else int(o) for s, o in zip(spatial, _n(output_size, k))]
    for axis, (size, o) in enumerate(zip(spatial, out)):
        dim = x.rank - k + axis
        if size == o:
            continue
        parts = [ctx.emit("REDUCE_MAX", [ctx.slice(x, dim, a, b), ctx.i32([dim])], "ReducerOptions",
                          out_shape=x.shape[:dim] + (1,) + x.shape[dim + 1:], out_dtype=x.dtype, keepDims=True)
                 for a, b in _adaptive_bins(size, o)]
        x = ctx.concat(parts, dim)
    return x


@lower(aten.adaptive_avg_pool1d)
def _(ctx, node, x, output_size):
    return adaptive_avg(ctx, x, output_size, 1)


@lower(aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d)
def _(ctx, node, x, output_size):
    return adaptive_avg(ctx, x, output_size, 2)


@lower(aten.adaptive_avg_pool3d, aten._adaptive_avg_pool3d)
def _(ctx, node, x, output_size):
    return adaptive_avg(ctx, x, output_size, 3)


def adaptive_max_indices(ctx, x, output_size, k):
    """(values, int64 argmax indices) of an adaptive max pool (1d / 2d, batched or not):
    one tap per position of the largest bin (a smaller bin repeats its last row, which
    leaves the first maximum first), each two GATHERs of constant rows and columns."""
    if x.rank == k + 1:
        y, i = adaptive_max_indices(ctx, ctx.reshape(x, (1,) + x.shape), output_size, k)
        return ctx.reshape(y, y.shape[1:]), ctx.reshape(i, i.shape[1:])
    if k == 1:
        y, i = adaptive_max_indices(ctx, ctx.reshape(x, x.shape[:2] + (1, x.shape[2])), (1,) + tuple(_n(output_size, 1)), 2)
        return ctx.reshape(y, y.shape[:2] + (y.shape[3],)), ctx.reshape(i, i.shape[:2] + (i.shape[3],))
    h, w = x.shape[2:]
    oh, ow = [s if o is None else int(o) for s, o in zip((h, w), _n(output_size, 2))]
    rows, cols = _adaptive_bins(h, oh), _adaptive_bins(w, ow)
    mh, mw = max(b - a for a, b in rows), max(b - a for a, b in cols)
    best = index = None
    for th in range(mh):
        r = [min(a + th, b - 1) for a, b in rows]
        xr = ctx.gather(x, r, 2)
        for tw in range(mw):
            c = [min(a + tw, b - 1) for a, b in cols]
            tap = ctx.gather(xr, c, 3)
            where = const_value((torch.tensor(r)[:, None] * w + torch.tensor(c)[None, :]).to(torch.float32))
            if best is None:
                best, index = tap, where
                continue
            better = ctx.cast(ctx.binary("GREATER", tap, best, out_dtype=torch.bool), torch.float32)
            index = ctx.add(index, ctx.mul(ctx.sub(where, index), better))
            best = ctx.binary("MAXIMUM", best, tap, dtype=x.dtype)
    if index.is_const:
        index = const_value(index.const.expand(best.shape).contiguous())
    return best, ctx.cast(index, torch.int64)


def _adaptive_max_lowering(k):
    def lowering(ctx, node, x, output_size):
        if any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
            if k == 3:
                raise ctx.unsupported("reads the indices of a 3d adaptive max pooling (return_indices=True)",
                                      "Pool without return_indices (1d and 2d pools return them).")
            return list(adaptive_max_indices(ctx, x, output_size, k))
        return [adaptive_max(ctx, x, output_size, k), None]
    return lowering


lower(aten.adaptive_max_pool1d)(_adaptive_max_lowering(1))
lower(aten.adaptive_max_pool2d)(_adaptive_max_lowering(2))
lower(aten.adaptive_max_pool3d)(_adaptive_max_lowering(3))
