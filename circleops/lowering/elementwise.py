"""Elementwise ops: arithmetic, unary math, activations, comparisons, select, casts."""
from __future__ import annotations

import math

import torch

from circleops.lowering.context import Value, result_type
from circleops.lowering.elementwise_math import unary_or_fallback
from circleops.lowering.registry import lower

aten = torch.ops.aten


# ------------------------------------------------------------------------ arithmetic
def _times_alpha(ctx, y, alpha):
    """y · alpha: the multiplier aten.add/sub/rsub apply to their second operand."""
    return y if alpha == 1 else (y * alpha if not isinstance(y, Value) else ctx.mul(y, alpha, ctx.out_dtype))


@lower(aten.add)
def _(ctx, node, x, y, alpha=1):
    if ctx.out_dtype == torch.bool:  # boolean add is logical or
        return ctx.binary("LOGICAL_OR", x, y, dtype=torch.bool)
    return ctx.add(x, _times_alpha(ctx, y, alpha), ctx.out_dtype)


@lower(aten.sub)
def _(ctx, node, x, y, alpha=1):
    return ctx.sub(x, _times_alpha(ctx, y, alpha), ctx.out_dtype)


@lower(aten.rsub)
def _(ctx, node, x, y, alpha=1):
    return ctx.sub(y, _times_alpha(ctx, x, alpha), ctx.out_dtype)


@lower(aten.mul)
def _(ctx, node, x, y):
    if ctx.out_dtype == torch.bool:  # no runtime multiplies booleans: that is logical and
        return ctx.binary("LOGICAL_AND", x, y, dtype=torch.bool)
    return ctx.mul(x, y, ctx.out_dtype)


@lower(aten.div.Tensor, aten.div.Scalar, aten.true_divide)
def _(ctx, node, x, y):
    return ctx.div(x, y, ctx.out_dtype)


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _(ctx, node, x, y, rounding_mode=None):
    if rounding_mode is None:
        return ctx.div(x, y, ctx.out_dtype)
    if rounding_mode == "floor":
        return ctx.binary("FLOOR_DIV", x, y, dtype=ctx.out_dtype)
    q = ctx.div(x, y, result_type(x, y) if ctx.out_dtype.is_floating_point else torch.float32)
    return ctx.cast(ctx.call(torch.trunc, q), ctx.out_dtype)


@lower(aten.floor_divide)
def _(ctx, node, x, y):
    return ctx.binary("FLOOR_DIV", x, y, dtype=ctx.out_dtype)


@lower(aten.remainder)
def _(ctx, node, x, y):
    return ctx.binary("FLOOR_MOD", x, y, dtype=ctx.out_dtype)


def minmax(ctx, opcode, x, y, dtype):
    """MAXIMUM / MINIMUM in ``dtype``. onert has no integer MAXIMUM, no int64 MINIMUM and
    no integer SELECT_V2 ("Max: unsupported data type"): there, integers compute
    x + (y - x) · [y > x] (resp. [y < x]) with ops it runs on int64."""
    if not dtype.is_floating_point and not ctx.supports(opcode, dtype):
        x, y = ctx.cast(x, dtype), ctx.cast(y, dtype)
        take_y = ctx.binary("GREATER" if opcode == "MAXIMUM" else "LESS", y, x, out_dtype=torch.bool)
        return ctx.add(x, ctx.mul(ctx.sub(y, x), ctx.cast(take_y, dtype)))
    return ctx.binary(opcode, x, y, dtype=dtype)


@lower(aten.maximum, aten.max.other)
def _(ctx, node, x, y):
    return minmax(ctx, "MAXIMUM", x, y, ctx.out_dtype)


@lower(aten.minimum, aten.min.other)
def _(ctx, node, x, y):
    return minmax(ctx, "MINIMUM", x, y, ctx.out_dtype)


@lower(aten.pow.Tensor_Scalar)
def _(ctx, node, x, exponent):
    x = ctx.cast(x, ctx.out_dtype)
    if exponent == 1:
        return x
    if exponent == 2:  # torch computes x*x for an exponent of 2: bit-identical
        return ctx.mul(x, x)
    if exponent == 0.5:
        return ctx.unary("SQRT", x)
    if exponent == -0.5:
        return ctx.unary("RSQRT", x)
    if exponent == -1:
        return ctx.div(1.0, x)
    return ctx.binary("POW", x, exponent, dtype=ctx.out_dtype)


@lower(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _(ctx, node, x, y):
    return ctx.binary("POW", x, y, dtype=ctx.out_dtype)


@lower(aten.square)
def _(ctx, node, x):
    x = ctx.cast(x, ctx.out_dtype)
    return ctx.mul(x, x)


@lower(aten.reciprocal)
def _(ctx, node, x):
    return ctx.div(1.0, x, ctx.out_dtype)


# ------------------------------------------------------------------------ unary math
_UNARY = {
    aten.neg: "NEG", aten.rsqrt: "RSQRT", aten.sqrt: "SQRT", aten.exp: "EXP", aten.log: "LOG",
    aten.sin: "SIN", aten.cos: "COS", aten.tanh: "TANH", aten.sigmoid: "LOGISTIC", aten.abs: "ABS",
    aten.relu: "RELU", aten.floor: "FLOOR", aten.ceil: "CEIL", aten.round: "ROUND", aten.sign: "SIGN",
    aten.logical_not: "LOGICAL_NOT", aten.relu6: "RELU6", aten.hardswish: "HARD_SWISH",
}


def _unary(opcode):
    def lowering(ctx, node, x):
        if opcode == "LOGICAL_NOT":
            return ctx.unary(opcode, ctx.cast(x, torch.bool))
        return unary_or_fallback(ctx, opcode, ctx.cast(x, ctx.out_dtype))
    return lowering


for _op, _code in _UNARY.items():
    lower(_op)(_unary(_code))


@lower(aten.exp2)
def _(ctx, node, x):
    # 2**x with POW: exact for the integer exponents power-of-two scaling uses
    return ctx.binary("POW", 2.0, x, dtype=ctx.out_dtype)


@lower(aten.log2)
def _(ctx, node, x):
    """log(x)/ln 2, snapped to the integer when x is a power of two (torch's log2 is exact
    there; ceil(log2(x)) in power-of-two scaling depends on it). Half inputs run in fp32."""
    h = ctx.cast(x, torch.float32)
    y = ctx.mul(ctx.unary("LOG", h), 1.0 / math.log(2.0))
    r = ctx.unary("ROUND", y)
    exact = ctx.binary("EQUAL", ctx.binary("POW", 2.0, r, dtype=torch.float32), h, out_dtype=torch.bool)
    y = ctx.emit("SELECT_V2", [exact, r, y], out_shape=y.shape, out_dtype=torch.float32)
    return ctx.cast(y, ctx.out_dtype)


@lower(aten.silu)
def _(ctx, node, x):
    return ctx.mul(x, ctx.unary("LOGISTIC", x))


@lower(aten.gelu)
def _(ctx, node, x, approximate="none"):
    return ctx.unary("GELU", x, "GeluOptions", approximate=approximate == "tanh")


@lower(aten.leaky_relu)
def _(ctx, node, x, negative_slope=0.01):
    return ctx.unary("LEAKY_RELU", x, "LeakyReluOptions", alpha=float(negative_slope))


@lower(aten.hardtanh)
def _(ctx, node, x, min_val=-1.0, max_val=1.0):
    return minmax(ctx, "MINIMUM", minmax(ctx, "MAXIMUM", x, min_val, x.dtype), max_val, x.dtype)


@lower(aten.clamp.default, aten.clamp.Tensor, aten.clip.default)
def _(ctx, node, x, min=None, max=None):
    y = ctx.cast(x, ctx.out_dtype)
    if min is not None:
        y = minmax(ctx, "MAXIMUM", y, min, ctx.out_dtype)
    if max is not None:
        y = minmax(ctx, "MINIMUM", y, max, ctx.out_dtype)
    return y


@lower(aten.clamp_min)
def _(ctx, node, x, min):
    return minmax(ctx, "MAXIMUM", x, min, ctx.out_dtype)


@lower(aten.clamp_max)
def _(ctx, node, x, max):
    return minmax(ctx, "MINIMUM", x, max, ctx.out_dtype)


# ------------------------------------------------------------------------ comparisons, logic
_COMPARE = {aten.eq: "EQUAL", aten.ne: "NOT_EQUAL", aten.lt: "LESS", aten.le: "LESS_EQUAL",
            aten.gt: "GREATER", aten.ge: "GREATER_EQUAL"}


def _compare(opcode):
    def lowering(ctx, node, x, y):
        return ctx.binary(opcode, x, y, out_dtype=torch.bool)
    return lowering


for _op, _code in _COMPARE.items():
    lower(_op)(_compare(_code))

_LOGIC = {aten.logical_and: "LOGICAL_AND", aten.logical_or: "LOGICAL_OR",
          aten.__and__: "LOGICAL_AND", aten.__or__: "LOGICAL_OR",
          aten.bitwise_and: "LOGICAL_AND", aten.bitwise_or: "LOGICAL_OR"}


def _logic(opcode):
    def lowering(ctx, node, x, y):
        if ctx.out_dtype != torch.bool:
            raise ctx.unsupported(f"computes a bitwise op on {ctx.out_dtype}", "Only boolean logic is supported.")
        return ctx.binary(opcode, x, y, dtype=torch.bool)
    return lowering


for _op, _code in _LOGIC.items():
    lower(_op)(_logic(_code))


@lower(aten.bitwise_not)
def _(ctx, node, x):
    # ~mask on a bool tensor (HF and DecoderWithCache build masks this way)
    if x.dtype != torch.bool:
        raise ctx.unsupported(f"computes a bitwise not on {x.dtype}", "Only boolean logic is supported.")
    return ctx.unary("LOGICAL_NOT", x)


@lower(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _(ctx, node, cond, x, y):
    return _select(ctx, cond, x, y)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _(ctx, node, x, mask, value):
    return _select(ctx, mask, value, x)


def _select(ctx, cond, x, y):
    dtype = ctx.out_dtype
    if isinstance(cond, Value) and cond.is_const and cond.numel > 0:
        # a constant all-true / all-false condition picks one side whole (a KV-cache write
        # that overwrites every slot): no SELECT_V2, and the other side never reaches the file
        picked = x if bool(cond.const.all()) else y if not bool(cond.const.any()) else None
        if isinstance(picked, Value) and picked.shape == ctx.out_shape:
            return ctx.cast(picked, dtype)
    cond, x, y = ctx.cast(cond, torch.bool), ctx.cast(x, dtype), ctx.cast(y, dtype)
    if ctx.supports("SELECT_V2", dtype):
        return ctx.broadcasting("SELECT_V2", [cond, x, y], ctx.out_shape, dtype)
    if dtype == torch.bool:  # (c and x) or (not c and y)
        return ctx.binary("LOGICAL_OR", ctx.binary("LOGICAL_AND", cond, x, dtype=torch.bool),
                          ctx.binary("LOGICAL_AND", ctx.unary("LOGICAL_NOT", cond), y, dtype=torch.bool), dtype=torch.bool)
    # integers: y + (x - y)·c, exact in the integer dtype
    return ctx.add(y, ctx.mul(ctx.sub(x, y), ctx.cast(cond, dtype)))


# ------------------------------------------------------------------------ softmax
def _last_dim(ctx, x, dim, fn):
    """Apply ``fn`` over the last dim, transposing ``dim`` there and back if needed."""
    dim %= x.rank
    if dim == x.rank - 1:
        return fn(x)
    perm = list(range(x.rank))
    perm[dim], perm[-1] = perm[-1], perm[dim]
    return ctx.transpose(fn(ctx.transpose(x, perm)), perm)


@lower(aten.softmax.int, aten._softmax)
def _(ctx, node, x, dim, dtype_or_half=None):
    x = ctx.cast(x, ctx.out_dtype)
    return _last_dim(ctx, x, dim, lambda t: ctx.unary("SOFTMAX", t, "SoftmaxOptions", beta=1.0))


@lower(aten.log_softmax.int, aten._log_softmax)
def _(ctx, node, x, dim, dtype_or_half=None):
    x = ctx.cast(x, ctx.out_dtype)
    return _last_dim(ctx, x, dim, lambda t: ctx.unary("LOG_SOFTMAX", t))


# ------------------------------------------------------------------------ casts and no-ops
@lower(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy,
       aten.type_as)
def _(ctx, node, x, *args, **kwargs):
    return ctx.cast(x, ctx.out_dtype)


@lower(aten.clone, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy, aten.lift_fresh)
def _(ctx, node, x, *args, **kwargs):
    return x


@lower(aten.dropout, aten.feature_dropout, aten.alpha_dropout)
def _(ctx, node, x, p, train):
    if train and p > 0:
        raise ctx.unsupported(f"applies dropout (p={p}) in training mode", "Call model.eval() before export.")
    return x
