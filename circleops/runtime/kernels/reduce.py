"""Reductions and normalisations over axes: MEAN/SUM/REDUCE_*, SOFTMAX, ARG_MAX, CUMSUM."""
from __future__ import annotations

import torch
from torch import Tensor

from circleops.runtime.kernels import KernelError, axis_of, ints, kernel, option, scalar


def _axes(x: Tensor, axes_t: Tensor) -> list[int]:
    # TFLite accepts negative and repeated axes.
    return sorted({axis_of(a, x.dim()) for a in ints(axes_t)})


def _reducer(reduce_all):
    def run(op, inputs, ctx):
        x, axes_t = inputs
        axes = _axes(x, axes_t)
        keep = bool(option(op, "keepDims", default=False))
        if not axes:  # reducing over no axis is the identity (torch would reduce over all)
            return [x]
        return [reduce_all(x, axes, keep)]

    return run


def _mean(x, axes, keep):
    if not x.is_floating_point():
        raise KernelError(f"MEAN of {x.dtype} is not supported")
    return x.mean(dim=axes, keepdim=keep)


def _sum(x, axes, keep):
    return x.sum(dim=axes, keepdim=keep, dtype=x.dtype)


def _prod(x, axes, keep):
    for a in axes:  # torch.prod takes one dim at a time
        x = x.prod(dim=a, keepdim=True, dtype=x.dtype)
    return x if keep else x.squeeze(tuple(axes))


_REDUCERS = {
    "MEAN": _mean,
    "SUM": _sum,
    "REDUCE_MAX": lambda x, axes, keep: x.amax(dim=axes, keepdim=keep),
    "REDUCE_MIN": lambda x, axes, keep: x.amin(dim=axes, keepdim=keep),
    "REDUCE_PROD": _prod,
    "REDUCE_ANY": lambda x, axes, keep: x.any(dim=tuple(axes), keepdim=keep),
    "REDUCE_ALL": lambda x, axes, keep: x.all(dim=tuple(axes), keepdim=keep),
}

for _name, _fn in _REDUCERS.items():
    kernel(_name)(_reducer(_fn))


@kernel("SOFTMAX")
def _softmax(op, inputs, ctx):
    x = inputs[0]
    beta = float(option(op, "beta", default=1.0))
    if beta != 1.0:
        x = x * beta
    return [torch.softmax(x, dim=-1)]


@kernel("LOG_SOFTMAX")
def _log_softmax(op, inputs, ctx):
    return [torch.log_softmax(inputs[0], dim=-1)]


@kernel("L2_NORMALIZATION")
def _l2_normalization(op, inputs, ctx):
    x = inputs[0]
    # TFLite: x / sqrt(max(sum(x²), 1e-6)) over the last dim.
    return [x * torch.rsqrt((x * x).sum(-1, keepdim=True).clamp_min(1e-6))]


@kernel("ARG_MAX", "ARG_MIN")
def _arg(op, inputs, ctx):
    x, axis_t = inputs
    axis = axis_of(int(scalar(axis_t)), x.dim())
    fn = torch.argmax if op.opcode == "ARG_MAX" else torch.argmin
    return [fn(x, dim=axis).to(ctx.out_dtype())]  # first index on ties, as TFLite


@kernel("CUMSUM")
def _cumsum(op, inputs, ctx):
    x, axis_t = inputs
    axis = axis_of(int(scalar(axis_t)), x.dim())
    exclusive = bool(option(op, "exclusive", default=False))
    reverse = bool(option(op, "reverse", default=False))
    if reverse:
        x = x.flip(axis)
    if exclusive:  # shift by one, so each sum is computed exactly as TFLite does
        zero = torch.zeros_like(x.narrow(axis, 0, 1))
        x = torch.cat((zero, x.narrow(axis, 0, x.shape[axis] - 1)), dim=axis)
    y = x.cumsum(axis, dtype=x.dtype)
    if reverse:
        y = y.flip(axis)
    return [y]


@kernel("TOPK_V2")
def _topk(op, inputs, ctx):
    x, k = inputs
    values, indices = torch.topk(x, int(scalar(k)), dim=-1, largest=True, sorted=True)
    return [values, indices.to(ctx.out_dtype(1))]
