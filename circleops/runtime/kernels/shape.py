"""Shape and indexing kernels: reshape, transpose, slicing, gather/scatter, padding, etc."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from circleops.quantize.ggml import BlockTensor
from circleops.runtime.kernels import (KernelError, activation, axis_of, check_alloc, enum_value, ints, kernel,
                                       option, same_dtype, scalar)


@kernel("RESHAPE")
def _reshape(op, inputs, ctx):
    x = inputs[0]
    shape_t = inputs[1] if len(inputs) > 1 else None
    if shape_t is not None:
        shape = ints(shape_t)
    else:
        shape = list(option(op, "newShape", default=None) or ctx.outputs[0].shape)
    # never allocates more than x: torch refuses a shape of another element count
    return [x.reshape(shape)]


@kernel("SQUEEZE")
def _squeeze(op, inputs, ctx):
    x = inputs[0]
    dims = [axis_of(int(d), x.dim()) for d in (option(op, "squeezeDims", default=None) or [])]
    if not dims:
        dims = [d for d, n in enumerate(x.shape) if n == 1]
    for d in dims:
        if x.shape[d] != 1:
            raise KernelError(f"SQUEEZE of dim {d} of size {x.shape[d]}")
    return [x.reshape([n for d, n in enumerate(x.shape) if d not in dims])]


@kernel("EXPAND_DIMS")
def _expand_dims(op, inputs, ctx):
    x, axis = inputs
    a = int(scalar(axis))
    return [x.unsqueeze(a if a >= 0 else a + x.dim() + 1)]


@kernel("TRANSPOSE")
def _transpose(op, inputs, ctx):
    x, perm = inputs
    return [x.permute(ints(perm))]


@kernel("CONCATENATION")
def _concatenation(op, inputs, ctx):
    same_dtype(op, *inputs)
    axis = axis_of(int(option(op, "axis", default=0)), inputs[0].dim())
    # one tensor may be listed thousands of times
    check_alloc([*inputs[0].shape[:axis], sum(t.shape[axis] for t in inputs if t.dim() > axis),
                 *inputs[0].shape[axis + 1:]], inputs[0].dtype, "CONCATENATION")
    return [activation(torch.cat(inputs, dim=axis), op)]


@kernel("PACK")
def _pack(op, inputs, ctx):
    same_dtype(op, *inputs)
    axis = int(option(op, "axis", default=0))
    check_alloc([len(inputs), *inputs[0].shape], inputs[0].dtype, "PACK")  # one tensor may be listed many times
    return [torch.stack(inputs, dim=axis if axis >= 0 else axis + inputs[0].dim() + 1)]


@kernel("UNPACK")
def _unpack(op, inputs, ctx):
    x = inputs[0]
    return list(torch.unbind(x, dim=axis_of(int(option(op, "axis", default=0)), x.dim())))


@kernel("SPLIT")
def _split(op, inputs, ctx):
    axis_t, x = inputs  # SPLIT takes the axis first
    axis = axis_of(int(scalar(axis_t)), x.dim())
    n = int(option(op, "numSplits", default=len(op.outputs)))
    if x.shape[axis] % n:
        raise KernelError(f"SPLIT of dim {axis} of size {x.shape[axis]} into {n} parts")
    return list(torch.split(x, x.shape[axis] // n, dim=axis))


@kernel("SPLIT_V")
def _split_v(op, inputs, ctx):
    x, sizes_t, axis_t = inputs
    axis = axis_of(int(scalar(axis_t)), x.dim())
    sizes = ints(sizes_t)
    if sizes.count(-1) == 1:
        sizes[sizes.index(-1)] = x.shape[axis] - (sum(sizes) + 1)
    return list(torch.split(x, sizes, dim=axis))


@kernel("SLICE")
def _slice(op, inputs, ctx):
    x, begin_t, size_t = inputs
    index = []
    for d, (b, s) in enumerate(zip(ints(begin_t), ints(size_t))):
        index.append(slice(b, x.shape[d] if s == -1 else b + s))
    return [x[tuple(index)]]


def _bit(mask: int, i: int) -> bool:
    return bool((mask >> i) & 1)


@kernel("STRIDED_SLICE")
def _strided_slice(op, inputs, ctx):
    x, begin_t, end_t = inputs[:3]
    begin, end = ints(begin_t), ints(end_t)
    strides = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else [1] * len(begin)
    begin_mask = int(option(op, "beginMask", default=0))
    end_mask = int(option(op, "endMask", default=0))
    ellipsis_mask = int(option(op, "ellipsisMask", default=0))
    new_axis_mask = int(option(op, "newAxisMask", default=0))
    shrink_mask = int(option(op, "shrinkAxisMask", default=0))
    use_offset = bool(option(op, "offset", default=False))

    # Sparse spec -> an index tuple (numpy/TF semantics agree on clamping). Negative strides
    # are not supported by torch slicing: those dims are reversed with index_select first.
    explicit = sum(1 for i in range(len(begin)) if not _bit(new_axis_mask, i) and not _bit(ellipsis_mask, i))
    index: list = []
    dim = 0
    for i in range(len(begin)):
        if _bit(ellipsis_mask, i):
            n = x.dim() - explicit
            index.extend([slice(None)] * n)
            dim += n
            continue
        if _bit(new_axis_mask, i):
            index.append(None)
            continue
        size = x.shape[dim]
        b, e, s = begin[i], end[i], strides[i]
        if s == 0:
            raise KernelError("STRIDED_SLICE stride 0")
        if use_offset:
            e = b + e
        if _bit(shrink_mask, i):
            idx = b + size if b < 0 else b
            if not 0 <= idx < size:
                raise KernelError(f"STRIDED_SLICE index {b} out of range for dim {dim} of size {size}")
            index.append(idx)
        else:
            start = None if _bit(begin_mask, i) else b
            stop = None if _bit(end_mask, i) else e
            rng = range(*slice(start, stop, s).indices(size))
            if s > 0:
                index.append(slice(rng.start, max(rng.stop, rng.start), s))
            else:
                x = x.index_select(dim, torch.tensor(list(rng), dtype=torch.long))
                index.append(slice(None))
        dim += 1
    index.extend([slice(None)] * (x.dim() - dim))
    return [x[tuple(index)]]


@kernel("GATHER")
def _gather(op, inputs, ctx):
    params, indices = inputs
    if isinstance(params, BlockTensor):  # a Q4_0 embedding table: unpack the picked rows
        if int(option(op, "axis", default=0)) != 0 or int(option(op, "batchDims", default=0)) != 0:
            raise KernelError(f"a {params.dtype} table is gathered along axis 0 only (batchDims 0)")
        check_alloc([*indices.shape, *params.shape[1:]], torch.float32, "GATHER")
        rows = params.rows(indices.to(torch.long).reshape(-1))
        return [rows.reshape(*indices.shape, *params.shape[1:])]
    axis = axis_of(int(option(op, "axis", default=0)), params.dim())
    batch_dims = int(option(op, "batchDims", default=0))
    if batch_dims < 0:
        batch_dims += indices.dim()
    # the result has a row per index: a few indices into a wide table make a big tensor
    check_alloc([*params.shape[:axis], *indices.shape[batch_dims:], *params.shape[axis + 1:]], params.dtype, "GATHER")
    idx = indices.to(torch.long)
    if batch_dims == 0:
        out = params.index_select(axis, idx.reshape(-1))
        return [out.reshape(*params.shape[:axis], *indices.shape, *params.shape[axis + 1:])]
    # Batched gather: each of the leading batch_dims slices gathers on its own.
    lead = params.shape[:batch_dims]
    p = params.reshape(-1, *params.shape[batch_dims:])
    i = idx.reshape(-1, *idx.shape[batch_dims:])
    a = axis - batch_dims + 1
    outs = [p[k].index_select(a - 1, i[k].reshape(-1)).reshape(
        *p.shape[1:a], *i.shape[1:], *p.shape[a + 1:]) for k in range(p.shape[0])]
    return [torch.stack(outs).reshape(*lead, *outs[0].shape)]


@kernel("GATHER_ND")
def _gather_nd(op, inputs, ctx):
    params, indices = inputs
    if indices.dim() > 0:
        check_alloc([*indices.shape[:-1], *params.shape[indices.shape[-1]:]], params.dtype, "GATHER_ND")
    idx = indices.to(torch.long)
    return [params[tuple(idx.unbind(-1))]]


@kernel("EMBEDDING_LOOKUP")
def _embedding_lookup(op, inputs, ctx):
    ids, table = inputs
    check_alloc([*ids.shape, *table.shape[1:]], table.dtype, "EMBEDDING_LOOKUP")
    return [table.index_select(0, ids.to(torch.long).reshape(-1)).reshape(*ids.shape, *table.shape[1:])]


@kernel("SCATTER_ND")
def _scatter_nd(op, inputs, ctx):
    indices, updates, shape_t = inputs
    check_alloc(ints(shape_t), updates.dtype, "SCATTER_ND")
    out = torch.zeros(ints(shape_t), dtype=updates.dtype)
    # TFLite sums updates that hit the same index.
    out.index_put_(tuple(indices.to(torch.long).unbind(-1)), updates, accumulate=True)
    return [out]


@kernel("DYNAMIC_UPDATE_SLICE")
def _dynamic_update_slice(op, inputs, ctx):
    operand, update, start_t = inputs
    same_dtype(op, operand, update)
    out = operand.clone()
    index = []
    for d, s in enumerate(ints(start_t)):
        s = min(max(s, 0), operand.shape[d] - update.shape[d])  # clamped so the update fits
        index.append(slice(s, s + update.shape[d]))
    out[tuple(index)] = update
    return [out]


@kernel("BROADCAST_TO")
def _broadcast_to(op, inputs, ctx):
    x, shape_t = inputs
    check_alloc(ints(shape_t), x.dtype, "BROADCAST_TO")
    return [x.expand(ints(shape_t))]


@kernel("TILE")
def _tile(op, inputs, ctx):
    x, multiples = inputs
    m = ints(multiples)
    check_alloc([a * b for a, b in zip([1] * (len(m) - x.dim()) + list(x.shape), m)], x.dtype, "TILE")
    return [x.repeat(m)]


@kernel("REVERSE_V2")
def _reverse(op, inputs, ctx):
    x, axes = inputs
    return [torch.flip(x, [axis_of(a, x.dim()) for a in ints(axes)])]


@kernel("PAD", "PADV2")
def _pad(op, inputs, ctx):
    x, paddings = inputs[0], ints(inputs[1])
    value = scalar(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else 0
    pad = []
    for d in reversed(range(x.dim())):
        pad += [paddings[2 * d], paddings[2 * d + 1]]
    check_alloc([n + paddings[2 * d] + paddings[2 * d + 1] for d, n in enumerate(x.shape)], x.dtype, op.opcode)
    return [torch.nn.functional.pad(x, pad, mode="constant", value=value)]


@kernel("MIRROR_PAD")
def _mirror_pad(op, inputs, ctx):
    x, paddings = inputs[0], ints(inputs[1])
    symmetric = enum_value(option(op, "mode", default=0), ("REFLECT", "SYMMETRIC")) == 1
    check_alloc([n + paddings[2 * d] + paddings[2 * d + 1] for d, n in enumerate(x.shape)], x.dtype, "MIRROR_PAD")
    for d in range(x.dim()):
        before, after = paddings[2 * d], paddings[2 * d + 1]
        if before == 0 and after == 0:
            continue
        n = x.shape[d]
        # REFLECT mirrors around the edge element (excluded), SYMMETRIC includes it.
        pos = torch.arange(-before, n + after)
        if symmetric:
            pos = torch.where(pos < 0, -pos - 1, pos)
            pos = torch.where(pos >= n, 2 * n - pos - 1, pos)
        else:
            pos = pos.abs()
            pos = torch.where(pos >= n, 2 * (n - 1) - pos, pos)
        if pos.min() < 0 or pos.max() >= n:
            raise KernelError(f"MIRROR_PAD padding ({before}, {after}) too large for dim {d} of size {n}")
        x = x.index_select(d, pos)
    return [x]


@kernel("SHAPE")
def _shape(op, inputs, ctx):
    return [torch.tensor(list(inputs[0].shape), dtype=ctx.out_dtype())]


@kernel("RANK")
def _rank(op, inputs, ctx):
    return [torch.tensor(inputs[0].dim(), dtype=ctx.out_dtype())]


@kernel("FILL")
def _fill(op, inputs, ctx):
    dims, value = inputs
    check_alloc(ints(dims), value.dtype, "FILL")
    return [torch.full(ints(dims), scalar(value), dtype=value.dtype)]


@kernel("RANGE")
def _range(op, inputs, ctx):
    start, limit, delta = inputs
    same_dtype(op, start, limit, delta)
    lo, hi, step = scalar(start), scalar(limit), scalar(delta)
    if step == 0 or step != step:
        raise KernelError(f"RANGE delta is {step}")
    check_alloc([max(0, math.ceil((hi - lo) / step))], start.dtype, "RANGE")
    return [torch.arange(scalar(start), scalar(limit), scalar(delta), dtype=start.dtype)]


@kernel("ONE_HOT")
def _one_hot(op, inputs, ctx):
    indices, depth, on, off = inputs
    axis = int(option(op, "axis", default=-1))
    d = int(scalar(depth))
    check_alloc([max(d, 0), *indices.shape], on.dtype, "ONE_HOT")
    hot = torch.arange(d).reshape(-1, *([1] * indices.dim())) == indices.to(torch.long).unsqueeze(0)
    out = torch.where(hot, on.reshape(()), off.reshape(()))
    # out is [depth, *indices.shape]; move depth to `axis`.
    return [out.movedim(0, axis if axis >= 0 else indices.dim())]


@kernel("WHERE")
def _where(op, inputs, ctx):
    check_alloc([int(torch.count_nonzero(inputs[0])), inputs[0].dim()], ctx.out_dtype(), "WHERE")
    return [torch.nonzero(inputs[0]).to(ctx.out_dtype())]
