"""Elementwise math that has no TFLite/Circle builtin (or none that every target runs),
written as short torch functions over ops that do have lowerings and traced inline with
``ctx.call``. Half inputs compute in float32, as torch's CPU kernels do.

The series and constants are chosen for float32: each function is within a few ulp of
torch over the whole float range (tests/coverage measures them on OpInfo's samples).
"""
from __future__ import annotations

import math

import torch

from circleops.lowering.registry import lower

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _f(x):
    return x.to(torch.float32) if x.dtype in _HALF or not x.dtype.is_floating_point else x


def _trunc(x):
    return torch.where(x < 0, -torch.floor(-x), torch.floor(x))


def _ceil(x):
    return -torch.floor(-x)


def _sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


def _hardswish(x):
    return x * torch.clamp(x + 3, 0, 6) / 6


def _log1p(x):
    # log(1 + x) loses x's low bits when |x| << 1; log(u)·x/(u-1) with u = 1 + x gives
    # them back (Goldberg), and u == 1 means log1p(x) = x to float precision
    u = 1 + x
    d = u - 1
    return torch.where(d == 0, x, torch.log(u) * (x / torch.where(d == 0, 1, d)))


def _expm1(x):
    # exp(x) - 1 cancels for |x| << 1; (u-1)·x/log(u) with u = exp(x) does not (Kahan)
    u = torch.exp(x)
    d = u - 1
    lg = torch.log(u)
    exact = (d == 0) | (lg == 0)
    return torch.where(u == 0, -1.0, torch.where(exact, x, torch.where(torch.isinf(u), u, d * (x / torch.where(exact, 1, lg)))))


def _atan(x):
    # |x| > 1 reflects to 1/|x|; two argument halvings, atan(t) = 2·atan(t / (1 + sqrt(1 + t²))),
    # bring t below tan(pi/16) = 0.199, where six terms of the Taylor series are exact in fp32
    a = torch.abs(x)
    big = a > 1
    t = torch.where(big, 1 / torch.where(big, a, 1), a)
    t = t / (1 + torch.sqrt(1 + t * t))
    t = t / (1 + torch.sqrt(1 + t * t))
    t2 = t * t
    p = t * (1 + t2 * (-1 / 3 + t2 * (1 / 5 + t2 * (-1 / 7 + t2 * (1 / 9 + t2 * (-1 / 11))))))
    r = 4 * p
    r = torch.where(big, math.pi / 2 - r, r)
    return torch.where(x < 0, -r, r)


def _atan2(y, x):
    r = _atan(y / x)
    r = torch.where(x < 0, torch.where(y < 0, r - math.pi, r + math.pi), r)
    return torch.where(x == 0, torch.where(y > 0, math.pi / 2, torch.where(y < 0, -math.pi / 2, 0.0)), r)


def _asin(x):
    return _atan(x / torch.sqrt((1 - x) * (1 + x)))


def _acos(x):
    return 2 * _atan(torch.sqrt((1 - x) / (1 + x)))


def _asinh(x):
    a = torch.abs(x)
    # log(a + sqrt(a² + 1)) = log1p(a + a²/(1 + sqrt(1 + a²))): exact for small a
    r = _log1p(a + a * a / (1 + torch.sqrt(1 + a * a)))
    big = a > 1e18  # a² overflows: asinh(a) = log(2a)
    r = torch.where(big, torch.log(torch.where(big, a, 1)) + math.log(2), r)
    return torch.where(x < 0, -r, r)


def _acosh(x):
    return torch.log(x + torch.sqrt((x - 1) * (x + 1)))


def _atanh(x):
    return 0.5 * (_log1p(x) - _log1p(-x))


def _sinh(x):
    return torch.where(torch.abs(x) < 1, 0.5 * (_expm1(x) - _expm1(-x)), 0.5 * (torch.exp(x) - torch.exp(-x)))


def _cosh(x):
    return 0.5 * (torch.exp(x) + torch.exp(-x))


def _tan(x):
    # reduce to [-pi/2, pi/2] first (pi in two parts, Cody-Waite): LiteRT's SIN/COS lose
    # digits on large arguments, and tan magnifies them
    k = torch.round(x * (1 / math.pi))
    r = (x - k * 3.140625) - k * 9.6765358979323846e-4
    # near the poles cos(r) = sin(pi/2 - |r|), whose small argument keeps its digits
    return torch.sin(r) / torch.sin((1.5703125 - torch.abs(r)) + 4.8382679489661923e-4)


def _erf(x):
    # Abramowitz & Stegun 7.1.26 is 1.5e-7 absolute; W. J. Cody's rational forms are more
    # exact but longer: for |x| < 0.5 the Taylor series (exact to 1e-8), else A&S
    a = torch.abs(x)
    x2 = a * a
    small = a * (1.1283791670955126 + x2 * (-0.37612638903183754 + x2 * (0.11283791670955126 + x2 * (
        -0.026866170645131252 + x2 * (0.005223977625442188 + x2 * -0.0008548327023450852)))))
    t = 1 / (1 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    large = 1 - poly * torch.exp(-x2)
    r = torch.where(a < 0.5, small, large)
    return torch.where(x < 0, -r, r)


_FUNCS = {
    aten.trunc: _trunc, aten.fix: _trunc, aten.log1p: _log1p, aten.expm1: _expm1, aten.atan: _atan,
    aten.asin: _asin, aten.acos: _acos, aten.asinh: _asinh, aten.acosh: _acosh, aten.atanh: _atanh,
    aten.sinh: _sinh, aten.cosh: _cosh, aten.tan: _tan, aten.erf: _erf,
    aten.log10: lambda x: torch.log(x) * (1 / math.log(10)),
}


def _via(fn):
    def traced(t):
        return fn(_f(t))

    def lowering(ctx, node, x):
        return ctx.cast(ctx.call(traced, x), ctx.out_dtype)
    return lowering


for _op, _fn in _FUNCS.items():
    lower(_op)(_via(_fn))


def unary_or_fallback(ctx, opcode, x):
    """``opcode`` on x where the target runs it, else its decomposition (onert: SIGN, CEIL,
    HARD_SWISH are not loaded)."""
    if ctx.supports(opcode, x.dtype) or opcode not in _FALLBACK:
        return ctx.unary(opcode, x)
    return ctx.call(_FALLBACK[opcode], x)


_FALLBACK = {"SIGN": _sign, "CEIL": _ceil, "HARD_SWISH": _hardswish}


@lower(aten.atan2)
def _(ctx, node, y, x):
    dtype = ctx.out_dtype
    if ctx.supports("ATAN2", dtype):
        y, x = ctx.cast(y, dtype), ctx.cast(x, dtype)
        if y.shape != ctx.out_shape or x.shape != ctx.out_shape:  # LiteRT's ATAN2 does not broadcast
            y, x = (v if v.shape == ctx.out_shape else ctx.emit("BROADCAST_TO", [v, ctx.i32(ctx.out_shape)], op_version=2)
                    for v in (y, x))
        return ctx.binary("ATAN2", y, x, dtype=dtype)
    return ctx.cast(ctx.call(_atan2_f32, ctx.cast(y, dtype), ctx.cast(x, dtype)), dtype)


def _atan2_f32(y, x):
    return _atan2(_f(y), _f(x))


@lower(aten.elu)
def _(ctx, node, x, alpha=1.0, scale=1.0, input_scale=1.0):
    if alpha == scale == input_scale == 1 and ctx.supports("ELU", x.dtype):
        return ctx.unary("ELU", x)
    return ctx.cast(ctx.call(_elu, x, float(alpha), float(scale), float(input_scale)), ctx.out_dtype)


def _elu(x, alpha, scale, input_scale):
    h = _f(x)
    return scale * torch.where(h > 0, h, alpha * _expm1(h * input_scale))


# ------------------------------------------------------------------------ predicates
@lower(aten.isnan)
def _(ctx, node, x):
    return ctx.binary("NOT_EQUAL", x, x, out_dtype=torch.bool)


@lower(aten.isinf)
def _(ctx, node, x):
    if not x.dtype.is_floating_point:
        return ctx.const(torch.zeros(x.shape, dtype=torch.bool))
    return ctx.binary("EQUAL", ctx.unary("ABS", x), float("inf"), out_dtype=torch.bool)


@lower(aten.isfinite)
def _(ctx, node, x):
    if not x.dtype.is_floating_point:
        return ctx.const(torch.ones(x.shape, dtype=torch.bool))
    # |x| < inf is false for inf and NaN alike
    return ctx.binary("LESS", ctx.unary("ABS", x), float("inf"), out_dtype=torch.bool)


@lower(aten.signbit)
def _(ctx, node, x):
    # -0.0 has its sign bit set: 1/-0.0 = -inf
    return ctx.call(_signbit, ctx.cast(x, torch.float32))


def _signbit(t):
    return (t < 0) | ((t == 0) & (1 / t < 0))


@lower(aten.logical_xor)
def _(ctx, node, a, b):
    return ctx.binary("NOT_EQUAL", ctx.cast(a, torch.bool), ctx.cast(b, torch.bool), dtype=torch.bool)


# ------------------------------------------------------------------------ binary math
def _fmod(a, b):
    # C fmod has the dividend's sign; FLOOR_MOD (torch.remainder) the divisor's
    r = torch.remainder(a, b)
    return torch.where((r != 0) & ((r < 0) != (a < 0)), r - b, r)


@lower(aten.fmod)
def _(ctx, node, a, b):
    dtype = ctx.out_dtype
    return ctx.call(_fmod, ctx.cast(a, dtype), ctx.cast(b, dtype))


@lower(aten.copysign)
def _(ctx, node, a, b):
    dtype = ctx.out_dtype
    neg = ctx.call(_signbit, ctx.cast(b, dtype))
    mag = ctx.unary("ABS", ctx.cast(a, dtype))
    return ctx.emit("SELECT_V2", [neg, ctx.unary("NEG", mag), mag])


@lower(aten.hypot)
def _(ctx, node, a, b):
    dtype = ctx.out_dtype
    return ctx.call(_hypot, ctx.cast(a, dtype), ctx.cast(b, dtype))


def _hypot(x, y):
    return torch.sqrt(x * x + y * y)


def _fmax(a, b):  # NaN only where both are NaN
    return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.maximum(a, b)))


def _fmin(a, b):
    return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.minimum(a, b)))


@lower(aten.fmax)
def _(ctx, node, a, b):
    return ctx.call(_fmax, ctx.cast(a, ctx.out_dtype), ctx.cast(b, ctx.out_dtype))


@lower(aten.fmin)
def _(ctx, node, a, b):
    return ctx.call(_fmin, ctx.cast(a, ctx.out_dtype), ctx.cast(b, ctx.out_dtype))
