"""Shape and data movement: views, transposes, slices, concatenation, gathers, padding."""
from __future__ import annotations

import math

import torch

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower

aten = torch.ops.aten


# ------------------------------------------------------------------------ views
@lower(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.squeeze,
       aten.unsqueeze, aten.view_as, aten.reshape_as)
def _(ctx, node, x, *args, **kwargs):
    return ctx.reshape(x, ctx.out_shape)


@lower(aten.expand, aten.expand_as, aten.broadcast_to)
def _(ctx, node, x, *args, **kwargs):
    shape = ctx.out_shape
    if shape == x.shape:
        return x
    if x.numel == torch.Size(shape).numel():  # only adds leading ones
        return ctx.reshape(x, shape)
    # BROADCAST_TO version 2: LiteRT rejects version 1 (shared/FACTS.md)
    return ctx.emit("BROADCAST_TO", [x, ctx.i32(shape)], op_version=2)


@lower(aten.permute)
def _(ctx, node, x, dims):
    return ctx.transpose(x, dims)


@lower(aten.transpose.int, aten.swapaxes, aten.swapdims)
def _(ctx, node, x, dim0, dim1):
    perm = list(range(x.rank))
    perm[dim0 % x.rank], perm[dim1 % x.rank] = perm[dim1 % x.rank], perm[dim0 % x.rank]
    return ctx.transpose(x, perm)


@lower(aten.t, aten.numpy_T)
def _(ctx, node, x):
    return ctx.transpose(x, list(reversed(range(x.rank))))


# ------------------------------------------------------------------------ slicing
def _bound(i, size, default):
    if i is None:
        return default
    i = int(i)
    if i < 0:
        i += size
    return min(max(i, 0), size)


@lower(aten.slice.Tensor)
def _(ctx, node, x, dim=0, start=None, end=None, step=1):
    size = x.shape[dim % x.rank]
    return ctx.slice(x, dim, _bound(start, size, 0), _bound(end, size, size), int(step))


@lower(aten.narrow)
def _(ctx, node, x, dim, start, length):
    start = _bound(start, x.shape[dim % x.rank], 0)
    return ctx.slice(x, dim, start, start + int(length))


@lower(aten.select.int)
def _(ctx, node, x, dim, index):
    index = int(index) % x.shape[dim % x.rank]
    return ctx.reshape(ctx.slice(x, dim, index, index + 1), ctx.out_shape)


def _pieces(ctx, x, dim, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(ctx.slice(x, dim, start, start + s))
        start += s
    return out


@lower(aten.split.Tensor, aten.split.sizes, aten.split_with_sizes, aten.chunk, aten.tensor_split.sections)
def _(ctx, node, x, *args, **kwargs):
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    sizes = [int(v.shape[dim % x.rank]) for v in node.meta["val"]]
    return _pieces(ctx, x, dim, sizes)


@lower(aten.unbind.int)
def _(ctx, node, x, dim=0):
    shape = list(x.shape)
    del shape[dim % x.rank]
    return [ctx.reshape(p, shape) for p in _pieces(ctx, x, dim, [1] * x.shape[dim % x.rank])]


@lower(aten.cat, aten.concat, aten.concatenate)
def _(ctx, node, tensors, dim=0):
    return ctx.concat(tensors, dim, ctx.out_dtype)


@lower(aten.stack)
def _(ctx, node, tensors, dim=0):
    dim %= tensors[0].rank + 1
    shape = list(tensors[0].shape)
    shape.insert(dim, 1)
    return ctx.concat([ctx.reshape(t, shape) for t in tensors], dim, ctx.out_dtype)


# ------------------------------------------------------------------------ gathers
@lower(aten.embedding)
def _(ctx, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return ctx.gather(weight, indices, 0)


@lower(aten.index_select)
def _(ctx, node, x, dim, index):
    return ctx.gather(x, index, dim)


@lower(aten.index.Tensor)
def _(ctx, node, x, indices):
    """x[i0, i1, ...] (advanced indexing) as one GATHER over the indexed dims flattened:
    the flat index is Σ i_k · stride_k, so any runtime with GATHER runs it."""
    dims = [d for d, t in enumerate(indices) if t is not None]
    if any(indices[d].dtype == torch.bool for d in dims):
        raise ctx.unsupported("indexes with a boolean mask (a data-dependent shape)",
                              "Use torch.where, or integer indices.")
    if dims != list(range(dims[0], dims[-1] + 1)):  # not adjacent: torch puts the index dims first
        rest = [d for d in range(x.rank) if d not in dims]
        x = ctx.transpose(x, dims + rest)
        dims = list(range(len(dims)))
        indices = [indices[d] for d in range(len(indices)) if indices[d] is not None]
    p, sizes = dims[0], [x.shape[d] for d in dims]
    flat = None
    for d, size in zip(dims, sizes):
        i = ctx.cast(indices[d], torch.int64)
        if i.is_const:
            i = const_value(torch.remainder(i.const, size))
        else:  # negative indices count from the end
            i = ctx.add(i, ctx.mul(ctx.cast(ctx.binary("LESS", i, 0, out_dtype=torch.bool), torch.int64), size))
        flat = i if flat is None else ctx.add(ctx.mul(flat, size), i)
    x = ctx.reshape(x, x.shape[:p] + (math.prod(sizes),) + x.shape[p + len(dims):])
    return ctx.gather(x, flat, p)


# ------------------------------------------------------------------------ constants of a shape
def _filled(ctx, value):
    return const_value(torch.full(ctx.out_shape, value, dtype=ctx.out_dtype))


@lower(aten.zeros_like, aten.new_zeros, aten.empty_like, aten.new_empty)
def _(ctx, node, *args, **kwargs):
    return _filled(ctx, 0)


@lower(aten.ones_like, aten.new_ones)
def _(ctx, node, *args, **kwargs):
    return _filled(ctx, 1)


@lower(aten.full_like)
def _(ctx, node, x, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@lower(aten.new_full)
def _(ctx, node, x, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@lower(aten.sym_size.int)
def _(ctx, node, x, dim):
    return x.shape[dim]


# ------------------------------------------------------------------------ tiling, padding, flips
@lower(aten.repeat)
def _(ctx, node, x, repeats):
    x = ctx.reshape(x, (1,) * (len(repeats) - x.rank) + x.shape)
    return ctx.emit("TILE", [x, ctx.i32(repeats)])


def pad_rows(rank, pad):
    """torch's flat pad list (last dim first) -> [[before, after]] per dim."""
    rows = [[0, 0] for _ in range(rank)]
    for i in range(len(pad) // 2):
        rows[rank - 1 - i] = [int(pad[2 * i]), int(pad[2 * i + 1])]
    return rows


@lower(aten.flip)
def _(ctx, node, x, dims):
    dims = sorted({d % x.rank for d in dims if x.shape[d % x.rank] > 1})
    for d in dims:
        if not ctx.supports("REVERSE_V2", x.dtype):  # onert's is float-only
            x = ctx.gather(x, list(range(x.shape[d] - 1, -1, -1)), d)
        else:  # one axis per REVERSE_V2: LiteRT reverses one axis only, and crashes on none
            x = ctx.emit("REVERSE_V2", [x, ctx.i32([d])], out_shape=x.shape, out_dtype=x.dtype)
    return x


@lower(aten.diff)
def _(ctx, node, x, n=1, dim=-1, prepend=None, append=None):
    x = ctx.concat([p for p in (prepend, x, append) if p is not None], dim)
    for _ in range(n):
        size = x.shape[dim % x.rank]
        hi, lo = ctx.slice(x, dim, 1, size), ctx.slice(x, dim, 0, size - 1)
        # bool diff is "changed" (torch: logical xor)
        x = ctx.binary("NOT_EQUAL", hi, lo, out_dtype=torch.bool) if x.dtype == torch.bool else ctx.sub(hi, lo)
    return x
