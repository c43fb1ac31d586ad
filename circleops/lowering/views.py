"""View-like gathers and the scatters scatter.py leaves, through flat positions into x.reshape(-1).

A gather-like op whose positions are constant (diagonal, unfold, repeat_interleave,
as_strided) is one GATHER of a constant index table. A scatter writes ``values`` at
``positions``: with constant positions, a GATHER of the last value written to each
element and a SELECT; with positions computed at run time (scatter, index_put with index
inputs), a comparison matrix [numel(x), len(positions)] and a reduction over it, which
keeps torch's order (the last write wins) and every reduce mode exact, on any runtime.
"""
from __future__ import annotations

import math

import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower
from circleops.lowering.select import gather_along

aten = torch.ops.aten
_MATRIX_MAX = 1 << 24  # elements of the comparison matrix of a run-time scatter


def _positions(x):
    return torch.arange(x.numel, dtype=torch.int64).reshape(x.shape)


def gather_positions(ctx, x, pos: torch.Tensor):
    """x.reshape(-1)[pos] for a constant position tensor (any shape)."""
    if pos.numel() == x.numel and torch.equal(pos.reshape(-1), torch.arange(x.numel)):
        return ctx.reshape(x, pos.shape)
    index = pos.reshape(-1).to(torch.int32 if x.numel < 2 ** 31 else torch.int64)
    return ctx.reshape(ctx.gather(ctx.reshape(x, (-1,)), const_value(index), 0), tuple(pos.shape))


def _identity(mode, dtype):
    if mode in ("sum", "mean"):
        return 0
    if mode == "prod":
        return 1
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    big = math.inf if dtype.is_floating_point else info.max
    return -big if mode == "amax" else big


def _combine(mode, old, new):
    return {"sum": torch.add, "prod": torch.mul, "amax": torch.maximum, "amin": torch.minimum}[mode](old, new)


def _scatter_matrix(x, pos, vals, mode: str, include_self: bool):
    """x [N] with vals [K] scattered at pos [K] (run-time positions)."""
    n, k = x.shape[0], pos.shape[0]
    hit = pos.unsqueeze(0) == torch.arange(n, device=x.device).unsqueeze(1)  # [N, K]
    touched = hit.any(1)
    if mode == "set":  # the last write wins, as torch's CPU kernel
        order = torch.where(hit, torch.arange(1, k + 1, dtype=torch.float32, device=x.device), 0.0)
        pick = hit & (order == order.amax(1, keepdim=True))
        return torch.where(touched, torch.where(pick, vals, 0).sum(1).to(x.dtype), x)
    spread = torch.where(hit, vals, _identity("sum" if mode == "mean" else mode, x.dtype))
    if mode == "mean":
        count = hit.to(x.dtype).sum(1) + (1 if include_self else 0)
        total = spread.sum(1) + (x if include_self else 0)
        mean = total / torch.where(count == 0, 1, count)
        if not x.dtype.is_floating_point:
            mean = torch.div(total, torch.where(count == 0, 1, count), rounding_mode="floor")
        return torch.where(touched, mean.to(x.dtype), x)
    reduced = {"sum": spread.sum, "prod": spread.prod, "amax": spread.amax, "amin": spread.amin}[mode](1)
    if include_self:
        reduced = _combine(mode, x, reduced)
    return torch.where(touched, reduced.to(x.dtype), x)


def scatter_flat(ctx, x, pos, vals, mode="set", include_self=True):
    """x with ``vals`` written at flat positions ``pos`` (same shape as vals); ``mode``:
    set (last write wins), sum, prod, mean, amax, amin."""
    shape = x.shape
    flat = ctx.reshape(x, (-1,))
    vals = ctx.reshape(ctx.cast(vals, x.dtype), (-1,))
    if pos.is_const:
        p = pos.const.reshape(-1).long()
        last = torch.full((x.numel,), -1, dtype=torch.int64)
        last[p] = torch.arange(p.numel())  # index_put keeps the last of duplicates
        counts = torch.bincount(p, minlength=x.numel)
        if mode == "set" or (counts.max() <= 1 and mode != "mean"):
            covered = last >= 0
            if bool(covered.all()) and mode == "set":
                new = ctx.gather(vals, const_value(last.to(torch.int32)), 0)
            else:
                new = ctx.gather(vals, const_value(last.clamp(min=0).to(torch.int32)), 0)
            if mode != "set" and include_self:
                new = ctx.call(_combine, mode, flat, new)
            if not bool(covered.all()):
                new = ctx.emit("SELECT_V2", [const_value(covered), new, flat], out_shape=flat.shape, out_dtype=x.dtype) \
                    if ctx.supports("SELECT_V2", x.dtype) else ctx.call(torch.where, const_value(covered), new, flat)
            return ctx.reshape(new, shape)
    if x.numel * vals.numel > _MATRIX_MAX:
        raise ctx.unsupported(f"scatters {vals.numel} values into {x.numel} elements at run-time positions",
                              "Make the indices constants of the model, or scatter into a smaller tensor.")
    pos = ctx.reshape(ctx.cast(pos, torch.int64), (-1,))
    return ctx.reshape(ctx.call(_scatter_matrix, flat, pos, vals, mode, bool(include_self)), shape)


# ------------------------------------------------------------------------ scatter
_REDUCE = {None: "set", "add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod", "mean": "mean",
           "amax": "amax", "amin": "amin"}


def scatter_reduce(ctx, x, dim, index, src, reduce=None, include_self=True):
    pos = gather_along(ctx, const_value(_positions(x)), dim, index)
    if isinstance(src, (int, float, bool)) or src.numel == 1:
        vals = ctx.const(torch.full(index.shape, src, dtype=x.dtype)) if not hasattr(src, "shape") else \
            ctx.emit("BROADCAST_TO", [ctx.cast(src, x.dtype), ctx.i32(index.shape)], out_shape=index.shape,
                     out_dtype=x.dtype, op_version=2)
    else:
        vals = src
        for d, size in enumerate(index.shape):  # torch reads src[index's extent] only
            vals = ctx.slice(vals, d, 0, size)
    return scatter_flat(ctx, x, pos, vals, _REDUCE[reduce], include_self)


@lower(aten.scatter_reduce.two)
def _(ctx, node, x, dim, index, src, reduce, include_self=True):
    return scatter_reduce(ctx, x, dim, index, src, reduce, include_self)


def masked_rows(ctx, x, mask, values, accumulate):
    """x[mask] = values (+= with accumulate) for a mask over x's leading dims and values
    the same for every selected row (broadcast to x.shape[mask.rank:]): a select, static.
    None when the values differ per row (their count depends on the data)."""
    rest = x.shape[mask.rank:]
    if values.rank > len(rest) + 1 or (values.rank == len(rest) + 1 and values.shape[0] != 1):
        return None
    vshape = values.shape[1:] if values.rank == len(rest) + 1 else values.shape
    if not _broadcasts(vshape, rest):
        return None
    m = ctx.reshape(mask, mask.shape + (1,) * len(rest))
    v = ctx.reshape(ctx.cast(values, x.dtype), vshape)
    return ctx.cast(ctx.call(torch.where, m, ctx.add(x, v) if accumulate else v, x), x.dtype)


def _broadcasts(shape, target):
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _masked_scatter(x, mask, source):
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    m = mask.expand(shape).reshape(-1)
    k = torch.cumsum(m.to(torch.int32), 0) - 1
    taken = source.reshape(-1)[k.clamp(min=0)]
    return torch.where(m, taken, x.expand(shape).reshape(-1)).reshape(shape)


@lower(aten.masked_scatter)
def _(ctx, node, x, mask, source):
    return ctx.call(_masked_scatter, x, mask, source)


# ------------------------------------------------------------------------ constant positions
@lower(aten.diagonal_scatter)
def _(ctx, node, x, src, offset=0, dim1=0, dim2=1):
    return scatter_flat(ctx, x, const_value(_positions(x).diagonal(offset, dim1, dim2).contiguous()), src)


@lower(aten.diagonal)
def _(ctx, node, x, offset=0, dim1=0, dim2=1):
    return gather_positions(ctx, x, _positions(x).diagonal(offset, dim1, dim2))


@lower(aten.unfold)
def _(ctx, node, x, dim, size, step):
    return gather_positions(ctx, x, _positions(x).unfold(dim, size, step))


@lower(aten.as_strided)
def _(ctx, node, x, size, stride, storage_offset=None):
    return gather_positions(ctx, x, torch.as_strided(_positions(x).reshape(-1), size, stride, storage_offset or 0))


@lower(aten.repeat_interleave.self_int)
def _(ctx, node, x, repeats, dim=None, output_size=None):
    pos = _positions(x)
    return gather_positions(ctx, x, pos.repeat_interleave(int(repeats), dim))


@lower(aten.repeat_interleave.self_Tensor)
def _(ctx, node, x, repeats, dim=None, output_size=None):
    if not repeats.is_const:
        raise ctx.unsupported("repeats elements a number of times given by a tensor input (a data-dependent shape)",
                              "Pass the repeats as a Python int, or as a constant of the model.")
    return gather_positions(ctx, x, _positions(x).repeat_interleave(repeats.const, dim))
