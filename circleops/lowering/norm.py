"""Normalisations other than the fused circle ops: instance norm (aten.instance_norm is
handled exactly like circle.instance_norm), inference batch norm (folded into a scale and
shift), layer norm, group norm and var/std (traced from small aten kernels that compute in
fp32 for half inputs, as torch's CPU kernels do)."""
from __future__ import annotations

import operator

import torch

from circleops.lowering.circle_ops import instance_norm
from circleops.lowering.context import const_value
from circleops.lowering.registry import lower

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


@lower(aten.instance_norm)
def _(ctx, node, x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    if not use_input_stats:
        return _batch_norm(ctx, x, weight, bias, running_mean, running_var, eps)
    return instance_norm(ctx, x, weight, bias, eps)


def _batch_norm(ctx, x, weight, bias, mean, var, eps):
    """Inference batch norm: x · s + t with s = w / sqrt(var + eps), t = b - mean · s."""
    shape = (1, x.shape[1]) + (1,) * (x.rank - 2)
    if not (mean.is_const and var.is_const and (weight is None or weight.is_const) and (bias is None or bias.is_const)):
        raise ctx.unsupported("normalizes with running statistics that are not constants",
                              "Export the model in eval mode with its statistics as buffers.")
    s = torch.rsqrt(var.const.float() + eps)
    if weight is not None:
        s = s * weight.const.float()
    t = -mean.const.float() * s
    if bias is not None:
        t = t + bias.const.float()
    y = ctx.mul(x, const_value(s.reshape(shape).to(x.dtype)), x.dtype)
    return ctx.add(y, const_value(t.reshape(shape).to(x.dtype)), x.dtype)


@lower(aten.batch_norm)
def _(ctx, node, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    if training:
        raise ctx.unsupported("runs batch norm in training mode", "Call model.eval() before export.")
    return _batch_norm(ctx, x, weight, bias, running_mean, running_var, eps)


@lower(aten._native_batch_norm_legit_no_training)
def _(ctx, node, x, weight, bias, running_mean, running_var, momentum, eps):
    return [_batch_norm(ctx, x, weight, bias, running_mean, running_var, eps), None, None]



def _layer_norm(x, normalized_shape, weight, bias, eps):
    dims = tuple(range(-len(normalized_shape), 0))
    h = x.to(torch.float32) if x.dtype in _HALF else x
    mean = h.mean(dims, keepdim=True)
    centered = h - mean
    y = centered * torch.rsqrt((centered * centered).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


@lower(aten.layer_norm)
def _(ctx, node, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return ctx.call(_layer_norm, x, list(normalized_shape), weight, bias, float(eps))


def _layer_norm_stats(x, normalized_shape, weight, bias, eps):
    dims = tuple(range(-len(normalized_shape), 0))
    h = x.to(torch.float32) if x.dtype in _HALF else x
    mean = h.mean(dims, keepdim=True)
    rstd = torch.rsqrt(((h - mean) * (h - mean)).mean(dims, keepdim=True) + eps)
    return _layer_norm(x, normalized_shape, weight, bias, eps), mean, rstd


def _stats_read(node):
    """Whether a (out, mean, rstd) op's statistics are read (an export for inference reads out only)."""
    return any(u.target is operator.getitem and u.args[1] != 0 for u in node.users)


@lower(aten.native_layer_norm)
def _(ctx, node, x, normalized_shape, weight, bias, eps):
    if not _stats_read(node):
        return [ctx.call(_layer_norm, x, list(normalized_shape), weight, bias, float(eps)), None, None]
    return list(ctx.call(_layer_norm_stats, x, list(normalized_shape), weight, bias, float(eps)))


def _group_norm(x, groups, weight, bias, eps):
    n, c = x.shape[:2]
    h = (x.to(torch.float32) if x.dtype in _HALF else x).reshape(n, groups, -1)
    mean = h.mean(-1, keepdim=True)
    centered = h - mean
    y = (centered * torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y.to(x.dtype)


def _group_norm_stats(x, n, c, hw, groups, weight, bias, eps):
    h = (x.to(torch.float32) if x.dtype in _HALF else x).reshape(n, groups, -1)
    mean = h.mean(-1, keepdim=True)
    rstd = torch.rsqrt(((h - mean) * (h - mean)).mean(-1, keepdim=True) + eps)
    return _group_norm(x, groups, weight, bias, eps), mean.reshape(n, groups), rstd.reshape(n, groups)


@lower(aten.native_group_norm)
def _(ctx, node, x, weight, bias, n, c, hw, groups, eps):
    if not _stats_read(node):
        return [ctx.call(_group_norm, x, int(groups), weight, bias, float(eps)), None, None]
    return list(ctx.call(_group_norm_stats, x, int(n), int(c), int(hw), int(groups), weight, bias, float(eps)))


@lower(aten.group_norm)
def _(ctx, node, x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return ctx.call(_group_norm, x, int(num_groups), weight, bias, float(eps))


def _rms_norm(x, normalized_shape, weight, eps):
    """aten.rms_norm: normalized in fp32, times the weight in fp32, then cast (OLMo2's order)."""
    dims = tuple(range(-len(normalized_shape), 0))
    h = x.to(torch.float32) if x.dtype in _HALF else x
    y = h * torch.rsqrt((h * h).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


@lower(aten.rms_norm)
def _(ctx, node, x, normalized_shape, weight=None, eps=None):
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    return ctx.call(_rms_norm, x, list(normalized_shape), weight, eps)


def _var(x, dims, correction, keepdim):
    h = x.to(torch.float32) if x.dtype in _HALF else x
    centered = h - h.mean(dims, keepdim=True)
    n = 1
    for d in dims:
        n *= x.shape[d]
    return ((centered * centered).sum(dims, keepdim=keepdim) / max(n - correction, 0)).to(x.dtype)


def _dims(x, dim):
    return tuple(range(x.rank)) if dim is None or len(dim) == 0 else tuple(int(d) % x.rank for d in dim)


@lower(aten.var.correction)
def _(ctx, node, x, dim=None, *, correction=None, keepdim=False):
    return ctx.call(_var, x, _dims(x, dim), 1 if correction is None else correction, keepdim)


@lower(aten.std.correction)
def _(ctx, node, x, dim=None, *, correction=None, keepdim=False):
    return ctx.unary("SQRT", ctx.call(_var, x, _dims(x, dim), 1 if correction is None else correction, keepdim))


@lower(aten.var_mean.correction)
def _(ctx, node, x, dim=None, *, correction=None, keepdim=False):
    dims = _dims(x, dim)
    var = ctx.call(_var, x, dims, 1 if correction is None else correction, keepdim)
    return [var, ctx.call(lambda t: t.mean(dims, keepdim=keepdim), x)]
