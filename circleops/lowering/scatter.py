"""Writes into a tensor, as static dataflow: copy, slice/select_scatter, index_put, scatter.

These are what functionalization (circleops.passes.functionalize) turns in-place writes
into (``x[:, 0] = v``, ``x.index_put_``, ``scores.masked_fill_``, ``g.scatter_(1, i, 1)``).
A write at data-dependent positions is a one-hot comparison of the indices with every
position followed by a select (or a sum, for accumulating writes), so it runs on any
runtime with EQUAL / SELECT_V2 / ARG_MAX, and never multiplies the written values (an
``-inf`` written into a mask stays ``-inf``). The dense forms are written in torch and
lowered through ``ctx.call``, so they reuse the lowerings of the ops they use.
"""
from __future__ import annotations

import math

import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower

aten = torch.ops.aten


@lower(aten.copy)
def _(ctx, node, x, src, non_blocking=False):
    # x.copy_(src): src's values, cast to x's dtype, broadcast to x's shape
    return ctx.call(_copy, x, src)


def _copy(x, src):
    return src.to(x.dtype).expand(x.shape)


def _bounds(size, start, end, step):
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size)), step


@lower(aten.slice_scatter)
def _(ctx, node, x, src, dim=0, start=None, end=None, step=1):
    dim %= x.rank
    start, end, step = _bounds(x.shape[dim], start, end, step)
    return slice_scatter(ctx, x, src, dim, start, end, step)


def slice_scatter(ctx, x, src, dim, start, end, step):
    """x with x[..., start:end:step, ...] (along ``dim``) replaced by src."""
    src = ctx.cast(src, x.dtype)
    if step == 1:
        parts = [ctx.slice(x, dim, 0, start), src, ctx.slice(x, dim, end, x.shape[dim])]
        return ctx.concat([p for p in parts if p.shape[dim] > 0] or [src], dim)
    n = x.shape[dim]
    picked = list(range(start, end, step))
    index = [picked.index(p) if p in picked else 0 for p in range(n)]
    mask = torch.zeros([n if d == dim else 1 for d in range(x.rank)], dtype=torch.bool)
    mask.view(-1)[picked] = True
    return ctx.call(_where_gathered, const_value(mask), src, const_value(torch.tensor(index)), x, dim)


def _where_gathered(mask, src, index, x, dim):
    return torch.where(mask, src.index_select(dim, index), x)


@lower(aten.select_scatter)
def _(ctx, node, x, src, dim, index):
    dim %= x.rank
    index %= x.shape[dim]
    return slice_scatter(ctx, x, ctx.reshape(src, x.shape[:dim] + (1,) + x.shape[dim + 1:]), dim, index, index + 1, 1)


# ------------------------------------------------------------------------ index_put
@lower(aten.index_put)
def _(ctx, node, x, indices, values, accumulate=False):
    indices = list(indices) + [None] * (x.rank - len(indices))
    dims = [d for d, i in enumerate(indices) if i is not None]
    if any(indices[d].dtype == torch.bool for d in dims):
        if len(dims) == 1 and values.numel == 1 and not accumulate:
            # x[mask] = v with one value: a select, whatever the mask holds
            mask = indices[dims[0]]
            mask = ctx.reshape(mask, (1,) * dims[0] + mask.shape + (1,) * (x.rank - dims[0] - mask.rank))
            return ctx.call(_masked_put, x, mask, values)
        from circleops.lowering.views import masked_rows

        if len(indices) - indices.count(None) == 1 and indices[0] is not None:
            y = masked_rows(ctx, x, indices[0], values, accumulate)  # the same row written to every hit
            if y is not None:
                return y
        raise ctx.unsupported(
            "writes through a boolean mask with more than one value (how many it writes depends on the data)",
            "Write x = torch.where(mask, values, x) with values of x's shape, or use integer indices.")
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    rest = [d for d in range(x.rank) if d not in dims]
    sizes = [x.shape[d] for d in dims]
    index_shape = torch.broadcast_shapes(*[indices[d].shape for d in dims])
    # values as laid out by x[indices]: the index dims in place of the indexed dims when
    # those are adjacent, else first; moved to the front for the flat [K, rest] form
    lead = dims[0] if adjacent else 0
    picked_shape = tuple(x.shape[d] for d in rest[:lead]) + tuple(index_shape) + tuple(x.shape[d] for d in rest[lead:])
    k = math.prod(index_shape)
    consts = dict(positions=const_value(torch.arange(math.prod(sizes))),
                  ranks=const_value(torch.arange(1, k + 1, dtype=torch.int32).unsqueeze(1)),
                  strides=[int(math.prod(sizes[k + 1:])) for k in range(len(sizes))])
    return ctx.call(_index_put_dense, x, [indices[d] for d in dims], values, dims=dims, sizes=sizes, rest=rest,
                    picked_shape=picked_shape, lead=lead, n_index=len(index_shape), accumulate=bool(accumulate),
                    **consts)


def _masked_put(x, mask, value):
    return torch.where(mask, value.to(x.dtype).reshape(()), x)


def _index_put_dense(x, indices, values, *, dims, sizes, rest, picked_shape, lead, n_index, accumulate,
                     positions, ranks, strides):
    flat = None
    for i, size, stride in zip(indices, sizes, strides):
        i = i.long()
        i = torch.where(i < 0, i + size, i) * stride
        flat = i if flat is None else flat + i
    flat = flat.reshape(-1)  # [K] positions in the flattened indexed dims
    rest_shape = [x.shape[d] for d in rest]
    x2 = x.permute(dims + rest).reshape([positions.shape[0]] + rest_shape)
    v = values.to(x.dtype).expand(picked_shape)
    order = list(range(lead, lead + n_index)) + list(range(lead)) + list(range(lead + n_index, len(picked_shape)))
    v = v.permute(order).reshape([flat.shape[0]] + rest_shape)
    hit = flat.unsqueeze(1) == positions.unsqueeze(0)  # [K, P] one-hot
    if accumulate:
        compute = x.dtype if x.dtype.is_floating_point else torch.float32
        added = hit.to(compute).transpose(0, 1) @ v.to(compute).reshape(flat.shape[0], -1)
        out = (x2.to(compute) + added.reshape(x2.shape)).to(x.dtype)
    else:
        # the last write to a position wins (torch's order on CPU): the largest k that hits it
        winner = torch.where(hit, ranks, torch.zeros_like(ranks)).argmax(0)  # [P]
        written = hit.any(0).reshape([positions.shape[0]] + [1] * len(rest_shape))
        out = torch.where(written, v.index_select(0, winner), x2)
    perm = dims + rest
    inverse = [perm.index(d) for d in range(x.dim())]
    return out.reshape(sizes + rest_shape).permute(inverse)


# ------------------------------------------------------------------------ scatter
@lower(aten.scatter.src, aten.scatter.value, aten.scatter_add, aten.scatter.reduce, aten.scatter.value_reduce)
def _(ctx, node, x, dim, index, src, reduce=None):
    add = node.target is aten.scatter_add.default or reduce == "add"
    if reduce not in (None, "add"):  # multiply: through flat positions (views.py)
        from circleops.lowering.views import scatter_reduce

        return scatter_reduce(ctx, x, dim, index, src, reduce)
    dim %= x.rank
    if not hasattr(src, "shape"):  # scatter.value: a Python number
        src = ctx.const(src, x.dtype)
    j = index.shape[dim]
    return ctx.call(_scatter_dense, x, index, src, dim=dim, add=add,
                    positions=const_value(torch.arange(x.shape[dim])),
                    later=const_value(torch.triu(torch.ones(j, j), 1)))


def _scatter_dense(x, index, src, *, dim, add, positions, later):
    shape = list(index.shape)
    cut = [d for d in range(x.dim()) if d != dim and shape[d] < x.shape[d]]
    regions = [x]  # the part of x the index covers (all of dim ``dim``), narrowed dim by dim
    for d in cut:
        regions.append(regions[-1].narrow(d, 0, shape[d]))
    src = src.to(x.dtype)
    src = src.expand(shape) if src.dim() == 0 else src
    for d in range(src.dim()):
        if src.shape[d] > shape[d]:
            src = src.narrow(d, 0, shape[d])
    # hit[..., j, n, ...] = index[..., j, ...] == n; then reduce over j
    hit = index.unsqueeze(dim + 1) == positions.reshape([-1 if d == dim + 1 else 1 for d in range(x.dim() + 1)])
    if not add:
        # the last write to a position wins (torch's order on CPU): drop hits a later j repeats
        hits_after = (hit.to(later.dtype).movedim(dim, -1) @ later.transpose(0, 1)).movedim(-1, dim)
        hit = hit & (hits_after == 0)
    picked = torch.where(hit, src.unsqueeze(dim + 1), src.new_zeros(())).sum(dim)
    out = regions[-1] + picked if add else torch.where(hit.any(dim), picked, regions[-1])
    for d, region in zip(reversed(cut), reversed(regions[:-1])):
        out = torch.slice_scatter(region, out, d, 0, shape[d])
    return out


# ------------------------------------------------------------------------ gather
@lower(aten.gather)
def _(ctx, node, x, dim, index, sparse_grad=False):
    """out[..., j, ...] = x[..., index[..., j, ...], ...] along ``dim``: advanced indexing
    with an arange for every other dim, so one GATHER over the flattened dims runs it."""
    dim %= max(x.rank, 1)
    grids = [None if d == dim else const_value(torch.arange(n).reshape([n if e == d else 1 for e in range(index.rank)]))
             for d, n in enumerate(index.shape)]
    return ctx.call(_gather_indexed, x, index, grids, dim=dim)


def _gather_indexed(x, index, grids, *, dim):
    return x[tuple(index if d == dim else g for d, g in enumerate(grids))]
