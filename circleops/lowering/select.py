"""Sorting: sort, argsort, kthvalue (aten.topk itself is in reduce.py), and the flat
gather the scatters use.

TOPK_V2 works on the last axis and returns the largest values (ties: lower index first,
as a stable torch sort): other dims are transposed there, smallest-first is the largest of
-x. Where the target has no TOPK_V2, a sort is a rank computation: each element's rank is
the number of elements before it in the order, and a one-hot of the ranks permutes values
and indices (O(n²) along the sorted dim: for routers and small dims).
"""
from __future__ import annotations

import torch

from circleops.lowering.registry import lower

aten = torch.ops.aten


_RANK_SORT_MAX = 1024  # n² comparisons per sorted row


def _to_last(ctx, x, dim):
    dim %= x.rank
    perm = [d for d in range(x.rank) if d != dim] + [dim]
    return ctx.transpose(x, perm), [perm.index(d) for d in range(x.rank)]


def _rank_topk(values, k: int, largest: bool):
    """(values, indices) of the k largest (smallest) along the last dim, by ranks."""
    n = values.shape[-1]
    a = values.unsqueeze(-1)   # [..., n, 1]: element i
    b = values.unsqueeze(-2)   # [..., 1, n]: element j
    ahead = (b > a) if largest else (b < a)
    ties = (b == a) & torch.ones(n, n, dtype=torch.bool, device=values.device).tril(-1)  # j < i
    rank = (ahead | ties).to(torch.float32).sum(-1)  # [..., n]
    slots = torch.arange(k, dtype=torch.float32, device=values.device).unsqueeze(-1)
    onehot = rank.unsqueeze(-2) == slots  # [..., k, n]
    # where(), not a product: a one-hot times inf would be NaN
    picked = torch.where(onehot, values.unsqueeze(-2), 0.0).sum(-1)
    index = (onehot.to(values.dtype) * torch.arange(n, dtype=values.dtype, device=values.device)).sum(-1)
    return picked, index


def topk(ctx, x, k, dim=-1, largest=True):
    """(values, int64 indices) of the k largest / smallest along ``dim``, sorted."""
    h, back = _to_last(ctx, x, dim)
    n = h.shape[-1]
    if ctx.supports("TOPK_V2", h.dtype):
        src = h if largest else ctx.unary("NEG", h)
        values, index = ctx.emit("TOPK_V2", [src, ctx.const(int(k), torch.int32)],
                                 outs=[(h.shape[:-1] + (k,), h.dtype), (h.shape[:-1] + (k,), torch.int32)])
        values = values if largest else ctx.unary("NEG", values)
    else:
        if n > _RANK_SORT_MAX:
            raise ctx.unsupported(f"sorts {n} elements on a target without TOPK_V2",
                                  "Sort fewer elements, or convert for target circle or tflite.")
        h32 = ctx.cast(h, torch.float32)
        values, index = ctx.call(_rank_topk, h32, int(k), bool(largest))
        values = ctx.cast(values, h.dtype)
    # the indices move back while int32 / float32 (onert transposes no int64)
    return ctx.transpose(values, back), ctx.cast(ctx.transpose(index, back), torch.int64)


@lower(aten.sort.default)
def _(ctx, node, x, dim=-1, descending=False):
    return list(topk(ctx, x, x.shape[dim % max(x.rank, 1)] if x.rank else 1, dim, descending))


@lower(aten.sort.stable)
def _(ctx, node, x, *, stable=None, dim=-1, descending=False):
    return list(topk(ctx, x, x.shape[dim % max(x.rank, 1)] if x.rank else 1, dim, descending))


@lower(aten.argsort.default, aten.argsort.stable)
def _(ctx, node, x, *args, dim=-1, descending=False, stable=False):
    if node.target is aten.argsort.default and args:
        dim, descending = (list(args) + [descending])[:2]
    return topk(ctx, x, x.shape[dim % max(x.rank, 1)] if x.rank else 1, dim, descending)[1]


@lower(aten.kthvalue)
def _(ctx, node, x, k, dim=-1, keepdim=False):
    values, index = topk(ctx, x, int(k), dim, largest=False)
    dim %= max(x.rank, 1)
    values, index = ctx.slice(values, dim, k - 1, k), ctx.slice(index, dim, k - 1, k)
    if not keepdim:
        shape = values.shape[:dim] + values.shape[dim + 1:]
        values, index = ctx.reshape(values, shape), ctx.reshape(index, shape)
    return [values, index]


# ------------------------------------------------------------------------ gather
def gather_along(ctx, x, dim, index):
    """torch.gather: out[p] = x[p with p[dim] = index[p]], as one GATHER from the flattened
    x at index·stride + the (constant) offset of the other coordinates."""
    dim %= max(x.rank, 1)
    strides = torch.ones(x.rank, dtype=torch.int64)
    for d in range(x.rank - 2, -1, -1):
        strides[d] = strides[d + 1] * x.shape[d + 1]
    grids = torch.meshgrid(*[torch.arange(s) for s in index.shape], indexing="ij")
    offset = sum(g * strides[d] for d, g in enumerate(grids) if d != dim)
    offset = offset if isinstance(offset, torch.Tensor) else torch.zeros(index.shape, dtype=torch.int64)
    flat = ctx.add(ctx.mul(ctx.cast(index, torch.int64), int(strides[dim])), ctx.const(offset), torch.int64)
    if ctx.supports("GATHER", torch.int32) and x.numel < 2 ** 31:
        flat = ctx.cast(flat, torch.int32)
    return ctx.reshape(ctx.gather(ctx.reshape(x, (-1,)), flat, 0), index.shape)
