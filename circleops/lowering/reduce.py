"""Reductions: mean, sum, max/min, prod, any/all, argmax/argmin, cumsum."""
from __future__ import annotations

import math

import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower

aten = torch.ops.aten


def _axes(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.rank))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return sorted({int(d) % max(x.rank, 1) for d in dims})


def reduce(ctx, opcode, x, dim, keepdim, dtype=None):
    """Reduce ``x`` over ``dim`` with a TFLite reducer (MEAN, SUM, REDUCE_MAX, ...)."""
    x = ctx.cast(x, dtype or (ctx.out_dtype if x.dtype != torch.bool else x.dtype))
    if opcode == "REDUCE_MIN" and not ctx.supports("REDUCE_MIN") and x.dtype.is_floating_point:
        # min(x) = -max(-x), exact
        return ctx.unary("NEG", reduce(ctx, "REDUCE_MAX", ctx.unary("NEG", x), dim, keepdim, x.dtype))
    axes = _axes(x, dim)
    kept = [1 if i in axes else d for i, d in enumerate(x.shape)]
    shape = kept if keepdim else [d for i, d in enumerate(x.shape) if i not in axes]
    if x.rank and not ctx.supports(opcode, rank=x.rank):
        x, axes = _within_rank(ctx, opcode, x, axes)
        y = ctx.emit(opcode, [x, ctx.i32(axes)], "ReducerOptions", out_dtype=x.dtype, keepDims=True,
                     out_shape=[1 if i in axes else d for i, d in enumerate(x.shape)])
        return ctx.reshape(y, shape)
    if not keepdim and not ctx.profile.reduce_drops_dims:
        y = ctx.emit(opcode, [x, ctx.i32(axes)], "ReducerOptions", out_shape=kept, out_dtype=x.dtype, keepDims=True)
        return ctx.reshape(y, shape)
    return ctx.emit(opcode, [x, ctx.i32(axes)], "ReducerOptions", out_shape=shape, out_dtype=x.dtype,
                    keepDims=bool(keepdim))


def _within_rank(ctx, opcode, x, axes):
    """``x`` reshaped (and ``axes`` renumbered) to a rank the target's reducer runs (onert:
    at most 4): adjacent reduced or kept dims merged, and where that is not enough, the
    reduced dims moved last first ([kept..., reduced...] -> [K, R])."""
    runs: list[list] = []  # [size, reduced?] per run of adjacent dims of one kind
    for i, d in enumerate(x.shape):
        if runs and runs[-1][1] == (i in axes):
            runs[-1][0] *= d
        else:
            runs.append([d, i in axes])
    if not ctx.supports(opcode, rank=len(runs)):
        x = ctx.transpose(x, [i for i in range(x.rank) if i not in axes] + list(axes))
        reduced = math.prod(x.shape[x.rank - len(axes):])
        runs = [[math.prod(x.shape[:x.rank - len(axes)]), False], [reduced, True]]
    return ctx.reshape(x, [size for size, _ in runs]), [i for i, (_, r) in enumerate(runs) if r]


def _over_dims(opcode: str):
    """The lowering of an aten reduction over ``dim`` (mean.dim, sum.dim_IntList, amax ...) as ``opcode``."""

    def lowering(ctx, node, x, dim=(), keepdim=False, dtype=None):
        return reduce(ctx, opcode, x, dim, keepdim)

    return lowering


def _over_all(opcode: str):
    """The lowering of an aten reduction of every element (mean.default, max.default ...) as ``opcode``."""

    def lowering(ctx, node, x, dtype=None):
        return reduce(ctx, opcode, x, None, False)

    return lowering


for _opcode, _dims, _all in (("MEAN", aten.mean.dim, aten.mean.default), ("SUM", aten.sum.dim_IntList, aten.sum.default),
                             ("REDUCE_MAX", aten.amax, aten.max.default), ("REDUCE_MIN", aten.amin, aten.min.default),
                             ("REDUCE_PROD", aten.prod.dim_int, aten.prod.default)):
    lower(_dims)(_over_dims(_opcode))
    lower(_all)(_over_all(_opcode))


@lower(aten.any.dim, aten.any.dims, aten.any.default)
def _(ctx, node, x, dim=None, keepdim=False):
    return reduce(ctx, "REDUCE_ANY", ctx.cast(x, torch.bool), dim, keepdim, torch.bool)


@lower(aten.all.dim, aten.all.dims, aten.all.default)
def _(ctx, node, x, dim=None, keepdim=False):
    # all(x) = not any(not x)
    inverted = ctx.unary("LOGICAL_NOT", ctx.cast(x, torch.bool))
    return ctx.unary("LOGICAL_NOT", reduce(ctx, "REDUCE_ANY", inverted, dim, keepdim, torch.bool))


def _arg(ctx, opcode, x, dim, keepdim):
    if dim is None:
        x, dim = ctx.reshape(x, (-1,)), 0
    dim %= x.rank
    shape = [d for i, d in enumerate(x.shape) if i != dim]
    y = ctx.emit(opcode, [x, ctx.i32([dim])], "ArgMaxOptions" if opcode == "ARG_MAX" else "ArgMinOptions",
                 out_shape=shape, out_dtype=torch.int64, outputType="INT64")
    if keepdim:
        y = ctx.reshape(y, [1 if i == dim else d for i, d in enumerate(x.shape)])
    return y


@lower(aten.argmax)
def _(ctx, node, x, dim=None, keepdim=False):
    return _arg(ctx, "ARG_MAX", x, dim, keepdim)


@lower(aten.argmin)
def _(ctx, node, x, dim=None, keepdim=False):
    return _arg(ctx, "ARG_MIN", x, dim, keepdim)


# (values, indices): the node's value is a pair, so the values' dtype is x's, not ctx.out_dtype
@lower(aten.max.dim)
def _(ctx, node, x, dim, keepdim=False):
    return [reduce(ctx, "REDUCE_MAX", x, dim, keepdim, x.dtype), _arg(ctx, "ARG_MAX", x, dim, keepdim)]


@lower(aten.min.dim)
def _(ctx, node, x, dim, keepdim=False):
    return [reduce(ctx, "REDUCE_MIN", x, dim, keepdim, x.dtype), _arg(ctx, "ARG_MIN", x, dim, keepdim)]


@lower(aten.cumsum)
def _(ctx, node, x, dim, dtype=None):
    dtype = ctx.out_dtype
    dim = int(dim) % x.rank
    if ctx.supports("CUMSUM"):
        return ctx.emit("CUMSUM", [ctx.cast(x, dtype), ctx.const(dim, torch.int32)], "CumsumOptions",
                        exclusive=False, reverse=False)
    # x · U with U upper-triangular ones, in float32: exact for the integer counts and
    # position arithmetic (< 2**24) this appears in (HF's packed-sequence mask)
    perm = [d for d in range(x.rank) if d != dim] + [dim]
    inverse = [perm.index(d) for d in range(x.rank)]
    n = x.shape[dim]
    h = ctx.transpose(ctx.cast(x, torch.float32), perm)
    tri = ctx.const(torch.tril(torch.ones(n, n, dtype=torch.float32)))  # FC weight [out, in]
    y = ctx.emit("FULLY_CONNECTED", [ctx.reshape(h, (-1, n)), tri, None], "FullyConnectedOptions",
                 out_shape=(h.numel // n, n), out_dtype=torch.float32, fusedActivationFunction=0, keepNumDims=False)
    return ctx.cast(ctx.transpose(ctx.reshape(y, h.shape), inverse), dtype)


@lower(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def _(ctx, node, x, dim=None):
    # counted in float32 (exact below 2**24): no runtime here sums booleans, onert no int64
    nonzero = ctx.cast(ctx.binary("NOT_EQUAL", x, 0, out_dtype=torch.bool), torch.float32)
    return ctx.cast(reduce(ctx, "SUM", nonzero, dim, False, torch.float32), torch.int64)


def _vector_norm(x, ord, dims, keepdim):
    a = torch.abs(x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x)
    if ord == 2:
        y = torch.sqrt((a * a).sum(dims, keepdim=keepdim))
    elif ord == 1:
        y = a.sum(dims, keepdim=keepdim)
    elif ord == float("inf"):
        y = a.amax(dims, keepdim=keepdim)
    elif ord == float("-inf"):
        y = a.amin(dims, keepdim=keepdim)
    elif ord == 0:
        y = (a != 0).to(a.dtype).sum(dims, keepdim=keepdim)
    else:
        y = torch.pow(torch.pow(a, ord).sum(dims, keepdim=keepdim), 1.0 / ord)
    return y.to(x.dtype)


@lower(aten.linalg_vector_norm)
def _(ctx, node, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    dims = tuple(_axes(x, dim))
    return ctx.cast(ctx.call(_vector_norm, ctx.cast(x, ctx.out_dtype), float(ord), dims, bool(keepdim)), ctx.out_dtype)


def _histc(x, bins, lo, hi):
    h = x.reshape(-1)
    if lo == hi:  # torch: the data's own range (and a width of 1 if that is a point)
        lo_t, hi_t = h.amin(), h.amax()
        same = lo_t == hi_t
        lo_t, hi_t = torch.where(same, lo_t - 1, lo_t), torch.where(same, hi_t + 1, hi_t)
    else:
        lo_t, hi_t = h.new_full((), lo), h.new_full((), hi)
    inside = (h >= lo_t) & (h <= hi_t)
    idx = torch.floor((h - lo_t) * bins / (hi_t - lo_t))
    idx = torch.where(h == hi_t, bins - 1, idx)
    hit = (idx.unsqueeze(0) == torch.arange(bins, dtype=h.dtype, device=h.device).unsqueeze(1)) & inside
    return hit.to(h.dtype).sum(1)


@lower(aten.histc)
def _(ctx, node, x, bins=100, min=0, max=0):
    if x.numel * bins > 1 << 24:
        raise ctx.unsupported(f"histograms {x.numel} values into {bins} bins", "Histogram fewer values or bins.")
    return ctx.call(_histc, ctx.cast(x, torch.float32), int(bins), float(min), float(max))


@lower(aten.topk)
def _(ctx, node, x, k, dim=-1, largest=True, sorted=True):
    """(values, indices) of the k largest (smallest) along ``dim``, as TOPK_V2 over the
    last axis (a transpose around it otherwise); indices int64 as torch returns them."""
    dim %= max(x.rank, 1)
    perm = [d for d in range(x.rank) if d != dim] + [dim]
    inverse = [perm.index(d) for d in range(x.rank)]
    h = ctx.transpose(x, perm)
    if not largest:
        h = ctx.unary("NEG", h)
    shape = h.shape[:-1] + (int(k),)
    if not ctx.supports("TOPK_V2"):
        values, indices = ctx.call(_topk_by_argmax, h, int(k), positions=const_value(torch.arange(h.shape[-1])))
        if not largest:
            values = ctx.unary("NEG", values)
        return [ctx.transpose(values, inverse), _indices_back(ctx, indices, inverse)]
    values, indices = ctx.emit("TOPK_V2", [h, ctx.const(int(k), torch.int32)], "TopKV2Options",
                               outs=[(shape, h.dtype), (shape, torch.int32)])
    if not largest:
        values = ctx.unary("NEG", values)
    return [ctx.transpose(values, inverse), _indices_back(ctx, indices, inverse)]


def _indices_back(ctx, indices, inverse):
    """int64 indices in the caller's layout; transposed as int32 (onert transposes no int64)."""
    if inverse != sorted(inverse):
        indices = ctx.transpose(ctx.cast(indices, torch.int32), inverse)
    return ctx.cast(indices, torch.int64)


def _topk_by_argmax(h, k, positions):
    """k rounds of argmax over the last axis, each masking its pick: for runtimes without
    TOPK_V2. Sorted, largest first; ties go to the lower index."""
    values, indices = [], []
    for _ in range(k):
        i = h.argmax(-1, keepdim=True)
        values.append(h.amax(-1, keepdim=True))
        indices.append(i)
        h = torch.where(positions == i, torch.full((), float("-inf"), dtype=h.dtype), h)
    return torch.cat(values, -1), torch.cat(indices, -1)
