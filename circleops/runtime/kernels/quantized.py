"""Integer kernels: the arithmetic of TFLite's reference kernels for quantized tensors.

Integer accumulation (int32 for 8-bit activations, int64 for 16-bit), and fixed-point
requantization: the real multiplier s_in·s_w/s_out becomes an int32 multiplier and a
shift (QuantizeMultiplier), applied with SaturatingRoundingDoublingHighMul and
RoundingDivideByPOT (MultiplyByQuantizedMultiplier), exactly as TFLite's C++ does.
Products are summed in float64 (exact below 2^53, far above any accumulator here) so
that torch's matmul and conv do the work.

Ops with no dedicated integer kernel follow the fused-op contract of schema/ops.yaml:
dequantize the quantized inputs, run the float kernel, requantize the quantized outputs.
Ops that only move data run on the integers directly when their input and output share
parameters.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from circleops import ir
from circleops.runtime.kernels import IN_PLACE, KERNELS, KernelContext, KernelError, check_alloc, enum_value, kernel, option

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-32768, 32767),
          torch.int32: (INT32_MIN, INT32_MAX), torch.int64: (-(2 ** 63), 2 ** 63 - 1)}


# --------------------------------------------------------------------------- fixed point
def quantize_multiplier(m: float) -> tuple[int, int]:
    """TFLite QuantizeMultiplier: m = q · 2^shift with q an int32 with the point at bit 31."""
    if m == 0.0:
        return 0, 0
    q, shift = math.frexp(m)
    q_fixed = int(math.floor(q * (1 << 31) + 0.5))  # std::round, q > 0
    if q_fixed == (1 << 31):
        q_fixed //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    if shift > 30:
        return (1 << 31) - 1, 30
    return q_fixed, shift


def _multipliers(real: Sequence[float]) -> tuple[Tensor, Tensor]:
    pairs = [quantize_multiplier(float(m)) for m in real]
    return (torch.tensor([p[0] for p in pairs], dtype=torch.int64),
            torch.tensor([p[1] for p in pairs], dtype=torch.int64))


def _pow2(e: Tensor) -> Tensor:
    return torch.bitwise_left_shift(torch.ones_like(e), e)


def saturating_rounding_doubling_high_mul(a: Tensor, b: Tensor) -> Tensor:
    ab = a * b
    nudge = torch.where(ab >= 0, torch.tensor(1 << 30), torch.tensor(1 - (1 << 30)))
    r = torch.div(ab + nudge, 1 << 31, rounding_mode="trunc")
    return torch.where((a == INT32_MIN) & (b == INT32_MIN), torch.tensor(INT32_MAX), r)


def rounding_divide_by_pot(x: Tensor, exponent: Tensor) -> Tensor:
    mask = _pow2(exponent) - 1
    remainder = torch.bitwise_and(x, mask)
    threshold = torch.bitwise_right_shift(mask, 1) + (x < 0).to(torch.int64)
    return torch.bitwise_right_shift(x, exponent) + (remainder > threshold).to(torch.int64)


def multiply_by_quantized_multiplier(x: Tensor, m: Tensor, shift: Tensor) -> Tensor:
    """TFLite MultiplyByQuantizedMultiplier(int32 x, int32 m, int shift), broadcast."""
    left = shift.clamp(min=0)
    right = (-shift).clamp(min=0)
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(x * _pow2(left), m), right)


def multiply_by_quantized_multiplier_64(x: Tensor, m: Tensor, shift: Tensor) -> Tensor:
    """TFLite MultiplyByQuantizedMultiplier(int64 x, ...) of the 16x8 kernels."""
    reduced = torch.where(m < 0x7FFF0000, torch.bitwise_right_shift(m + (1 << 15), 16), torch.tensor(0x7FFF))
    total = 15 - shift
    rnd = _pow2(total - 1)
    return torch.bitwise_right_shift(x * reduced + rnd, total)


# --------------------------------------------------------------------------- helpers
def params(t: ir.Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(scale float64, zero point int64), shaped to broadcast over a rank-``rank`` tensor."""
    q = t.quant
    scale = torch.from_numpy(np.asarray(q.scale, np.float64).copy())
    zp = torch.from_numpy(np.asarray(q.zero_point, np.int64).copy())
    if scale.numel() > 1:
        shape = [1] * rank
        shape[q.quantized_dimension] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return scale.reshape(scale.shape if scale.numel() > 1 else ()), zp.reshape(zp.shape if zp.numel() > 1 else ())


def dequantize(q: Tensor, t: ir.Tensor) -> Tensor:
    if t.quant.blockwise is not None:  # s_row · m[row, group] · q (ir.Blockwise)
        b = t.quant.blockwise
        rows, cols = q.shape
        m = torch.as_tensor(np.asarray(b.scales.data)).to(torch.float32).reshape(rows, cols // b.block_size)
        s = torch.from_numpy(np.asarray(t.quant.scale, np.float32).copy())[:, None] * m
        return q.to(torch.float32) * s.repeat_interleave(b.block_size, dim=1)
    scale, zp = params(t, q.dim())
    if q.dtype in _EXACT_IN_FLOAT32 and (zp.numel() == 0 or int(zp.abs().max()) < 1 << 16):
        # the same float32 values without an int64 copy of the tensor: integers of at most 16
        # bits, their zero points and differences are exact in float32 (verify of the 16a4w
        # recipe at the Llama-3.2-1B shape: a 2.1 GB int64 temporary per 1.05 GB table, issue 32)
        out = q.to(torch.float32)
        out -= zp.to(torch.float32)
        out *= scale.to(torch.float32)
        return out
    return ((q.to(torch.int64) - zp).to(torch.float32) * scale.to(torch.float32))


_EXACT_IN_FLOAT32 = (torch.int8, torch.uint8, torch.int16)


def quantize(x: Tensor, t: ir.Tensor) -> Tensor:
    """TFLite AffineQuantize: round half away from zero of x / scale (float32), + zero point."""
    scale, zp = params(t, x.dim())
    v = x.to(torch.float32) / scale.to(torch.float32)
    r = torch.sign(v) * torch.floor(v.abs() + 0.5)
    lo, hi = _RANGE[t.torch_dtype]
    return (r.to(torch.int64) + zp).clamp(lo, hi).to(t.torch_dtype)


_ACT = ("NONE", "RELU", "RELU_N1_TO_1", "RELU6")


def _clamp_out(acc: Tensor, out: ir.Tensor, op: ir.Operator) -> Tensor:
    """Add nothing, clamp to the output dtype and the fused activation's range."""
    lo, hi = _RANGE[out.torch_dtype]
    code = enum_value(op.options.get("fusedActivationFunction", 0), _ACT + ("TANH", "SIGN_BIT"))
    if code in (1, 2, 3):
        s, z = float(out.quant.scale[0]), int(out.quant.zero_point[0])
        real_lo, real_hi = {1: (0.0, None), 2: (-1.0, 1.0), 3: (0.0, 6.0)}[code]
        lo = max(lo, z + int(round(real_lo / s)))
        if real_hi is not None:
            hi = min(hi, z + int(round(real_hi / s)))
    elif code:
        raise KernelError(f"fused activation {code} on a quantized {op.opcode} is not supported")
    return acc.clamp(lo, hi).to(out.torch_dtype)


def _wide(t: ir.Tensor) -> bool:
    return t.dtype == "INT16"


def _requantize_acc(acc: Tensor, real: Sequence[float], out: ir.Tensor, op: ir.Operator, wide: bool,
                    channel_dim: int) -> Tensor:
    m, shift = _multipliers(real)
    if m.numel() > 1:
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        m, shift = m.reshape(shape), shift.reshape(shape)
    else:
        m, shift = m.reshape(()), shift.reshape(())
    scaled = multiply_by_quantized_multiplier_64(acc, m, shift) if wide else \
        multiply_by_quantized_multiplier(acc, m, shift)
    return _clamp_out(scaled + int(out.quant.zero_point[0]), out, op)


def _offsets(x: Tensor, t: ir.Tensor) -> Tensor:
    """q - zero_point as float64 (exact), per channel when the tensor is."""
    _, zp = params(t, x.dim())
    return (x.to(torch.int64) - zp).to(torch.float64)


def _out_scales(x_t: ir.Tensor, w_t: ir.Tensor, out_t: ir.Tensor) -> list[float]:
    s_in, s_out = float(np.float64(x_t.quant.scale[0])), float(np.float64(out_t.quant.scale[0]))
    return [s_in * float(np.float64(s)) / s_out for s in w_t.quant.scale]


def _bias(b: Optional[Tensor]) -> Optional[Tensor]:
    return None if b is None else b.to(torch.float64)


# --------------------------------------------------------------------------- integer kernels
QUANTIZED: dict[str, Callable] = {}


def qkernel(*opcodes: str):
    def register(fn):
        for name in opcodes:
            QUANTIZED[name] = fn
        return fn
    return register


@qkernel("FULLY_CONNECTED")
def _fc(op, inputs, ctx):
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    xt, wt, ot = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    check_alloc([x.numel() // max(w.shape[1], 1), w.shape[0]], torch.int64, "FULLY_CONNECTED")
    xs = _offsets(x, xt).reshape(-1, w.shape[1])
    acc = _blockwise_acc(xs, w, wt) if wt.quant.blockwise is not None else _rows_product(xs, w, wt)
    if b is not None:
        acc = acc + _bias(b)
    acc = acc.round().to(torch.int64)
    y = _requantize_acc(acc, _out_scales(xt, wt, ot), ot, op, _wide(xt), 1)
    if option(op, "keepNumDims", default=False):
        y = y.reshape(*x.shape[:-1], w.shape[0])
    return [y]


# weight elements whose offsets are made at a time by _rows_product (8 bytes each in float64)
FC_BLOCK = 1 << 20


def _rows_product(xs: Tensor, w: Tensor, wt: ir.Tensor) -> Tensor:
    """xs @ (w - zero point)ᵀ in float64, a block of the weight's rows at a time: every sum is
    of integers below 2^53, exact in any order, so the same values as the whole product.
    Whole, the offsets of the 16a4w recipe's int8 lm_head at the Llama-3.2-1B shape were an
    int64 and a float64 copy of it (2 x 2.1 GB) on every step verify ran (issue 32)."""
    _, zp = params(wt, w.dim())
    per_row = zp.dim() == 2 and zp.shape[0] == w.shape[0] and zp.shape[0] > 1
    out = torch.empty(xs.shape[0], w.shape[0], dtype=torch.float64)
    step = max(1, FC_BLOCK // max(1, w.shape[1]))
    for i in range(0, w.shape[0], step):
        r = slice(i, i + step)
        offsets = w[r].to(torch.float64) - (zp[r] if per_row else zp).to(torch.float64)
        out[:, r] = xs @ offsets.T
    return out


def _blockwise_acc(xs: Tensor, w: Tensor, wt: ir.Tensor) -> Tensor:
    """Σ_g m[o, g] · Σ_{k in g} x[n, k] · q[o, k]: each group's integer sum weighted by its
    integer multiplier (the UINT8 scales tensor; ir.Blockwise), in the accumulator's units
    s_in · s_row, so that one per-row requantization follows (an NPU's fixed-point form)."""
    b = wt.quant.blockwise
    scales = b.scales
    if scales.dtype != "UINT8" or scales.data is None or scales.quant is None \
            or np.any(np.asarray(scales.quant.zero_point) != 0):
        raise KernelError(f"FULLY_CONNECTED weight {wt.name!r}: blockwise scales tensor {scales.name!r} is "
                          f"{scales.dtype}; the interpreter computes UINT8 group multipliers of per-row scales "
                          "(zero point 0), as circleops writes them")
    if not np.allclose(np.asarray(scales.quant.scale, np.float64), np.asarray(wt.quant.scale, np.float64)):
        raise KernelError(f"FULLY_CONNECTED weight {wt.name!r}: its row scales differ from its blockwise scales "
                          f"tensor's ({scales.name!r})")
    rows, cols = w.shape
    group = b.block_size
    m = torch.as_tensor(np.asarray(scales.data)).to(torch.float64).reshape(rows, cols // group)
    xg = xs.reshape(xs.shape[0], cols // group, group)
    wg = w.to(torch.float64).reshape(rows, cols // group, group)
    per_group = torch.einsum("ngk,ogk->nog", xg, wg)  # exact integers (below 2^53)
    return (per_group * m[None]).sum(-1)


def _conv_common(op, inputs, ctx, depthwise: bool):
    from circleops.runtime.kernels.nn import check_conv, conv_layout, conv_window, pad_nchw

    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    xt, wt, ot = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    window = conv_window(op, w)
    xc = pad_nchw(_offsets(x, xt).permute(0, 3, 1, 2), op, window)
    filters, groups, out_channels = conv_layout(x, _offsets(w, wt), depthwise)
    check_conv(xc, window, out_channels, torch.int64, op.opcode)
    acc = F.conv2d(xc, filters, _bias(b), stride=window.stride, dilation=window.dilation, groups=groups)
    acc = acc.permute(0, 2, 3, 1).round().to(torch.int64)
    return [_requantize_acc(acc, _out_scales(xt, wt, ot), ot, op, _wide(xt), 3)]


@qkernel("CONV_2D")
def _conv(op, inputs, ctx):
    return _conv_common(op, inputs, ctx, False)


@qkernel("DEPTHWISE_CONV_2D")
def _depthwise(op, inputs, ctx):
    return _conv_common(op, inputs, ctx, True)


@qkernel("BATCH_MATMUL")
def _bmm(op, inputs, ctx):
    a, b = inputs
    at, bt, ot = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    from circleops.runtime.kernels.nn import check_matmul

    if option(op, "adjX", "adjointLhs", default=False):  # the float kernel's adjoint flags
        a = a.transpose(-1, -2)
    if option(op, "adjY", "adjointRhs", default=False):
        b = b.transpose(-1, -2)
    check_matmul(a.shape, b.shape, torch.int64, "BATCH_MATMUL")
    acc = torch.matmul(_offsets(a, at), _offsets(b, bt)).round().to(torch.int64)
    real = float(at.quant.scale[0]) * float(bt.quant.scale[0]) / float(ot.quant.scale[0])
    return [_requantize_acc(acc, [real], ot, op, _wide(at), 0)]


def _add_sub(op, inputs, ctx, sign: int):
    a, b = inputs
    at, bt, ot = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    left_shift = 15 if _wide(at) else 20
    s1, s2, so = (float(np.float64(t.quant.scale[0])) for t in (at, bt, ot))
    twice_max = 2 * max(s1, s2)
    m1, e1 = _multipliers([s1 / twice_max])
    m2, e2 = _multipliers([s2 / twice_max])
    mo, eo = _multipliers([twice_max / ((1 << left_shift) * so)])
    q1 = (a.to(torch.int64) - int(at.quant.zero_point[0])) * (1 << left_shift)
    q2 = (b.to(torch.int64) - int(bt.quant.zero_point[0])) * (1 << left_shift)
    r1 = multiply_by_quantized_multiplier(q1, m1[0], e1[0])
    r2 = multiply_by_quantized_multiplier(q2, m2[0], e2[0])
    out = multiply_by_quantized_multiplier(r1 + sign * r2, mo[0], eo[0]) + int(ot.quant.zero_point[0])
    return [_clamp_out(out, ot, op)]


@qkernel("ADD")
def _add(op, inputs, ctx):
    return _add_sub(op, inputs, ctx, 1)


@qkernel("SUB")
def _sub(op, inputs, ctx):
    return _add_sub(op, inputs, ctx, -1)


@qkernel("MUL")
def _mul(op, inputs, ctx):
    a, b = inputs
    at, bt, ot = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    prod = (a.to(torch.int64) - int(at.quant.zero_point[0])) * (b.to(torch.int64) - int(bt.quant.zero_point[0]))
    real = float(np.float64(at.quant.scale[0])) * float(np.float64(bt.quant.scale[0])) / float(np.float64(ot.quant.scale[0]))
    return [_requantize_acc(prod, [real], ot, op, False, 0)]


# data movement: integers in, integers out, when the parameters agree
DIRECT = frozenset({"RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "STRIDED_SLICE", "SLICE", "GATHER",
                    "CONCATENATION", "MAX_POOL_2D", "SPLIT", "TILE", "BROADCAST_TO", "RESIZE_NEAREST_NEIGHBOR",
                    "MIRROR_PAD", "REVERSE_V2"})


def _same_params(ts: Sequence[ir.Tensor]) -> bool:
    first = ts[0]
    return all(t.dtype == first.dtype and t.quant is not None and np.array_equal(t.quant.scale, first.quant.scale)
               and np.array_equal(t.quant.zero_point, first.quant.zero_point) for t in ts)


def _generic(float_kernel):
    """dequantize -> float kernel -> requantize (the fused ops' contract)."""
    def run(op, inputs, ctx):
        xs = [dequantize(x, t) if (x is not None and t is not None and t.quant is not None) else x
              for x, t in zip(inputs, ctx.inputs)]
        ys = float_kernel(op, xs, ctx)
        # results past the declared outputs are written in place into inputs (ATTENTION's
        # caches): requantized with those inputs' parameters (a cache of fixed scale)
        written = [ctx.inputs[p] for p in IN_PLACE.get(op.opcode, ())] if len(ys) > len(ctx.outputs) else []
        outs = list(ctx.outputs) + written
        outs += [None] * (len(ys) - len(outs))
        return [quantize(y, t) if t is not None and t.quant is not None else y for y, t in zip(ys, outs)]
    return run


def is_hybrid_fc(op: ir.Operator, ctx: KernelContext) -> bool:
    """A FULLY_CONNECTED with a float input and output and an INT8 weight: onert's hybrid kernel
    (the input quantized per row at run time; circleops.quantize.int8, ``--quantize w8``)."""
    if op.opcode != "FULLY_CONNECTED" or len(ctx.inputs) < 2 or ctx.inputs[1] is None:
        return False
    x, w, out = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    return (w.dtype in ("INT8", "INT4") and w.quant is not None and x is not None and x.quant is None
            and x.dtype == "FLOAT32" and out.quant is None and out.dtype == "FLOAT32")


def select(op: ir.Operator, ctx: KernelContext) -> Optional[Callable]:
    """The kernel for ``op`` when it touches quantized tensors, else None (the float kernel)."""
    ins = [t for t in ctx.inputs if t is not None]
    quantized_ins = [t for t in ins if t.quant is not None]
    quantized_outs = [t for t in ctx.outputs if t.quant is not None]
    if op.opcode == "DEQUANTIZE" and quantized_ins:
        return _dequantize
    if op.opcode in ("QUANTIZE", "DEQUANTIZE") or not (quantized_ins or quantized_outs):
        return None
    if is_hybrid_fc(op, ctx):
        return None  # the FULLY_CONNECTED kernel computes it as onert does (kernels/nn.py)
    if op.opcode in QUANTIZED and len(quantized_ins) >= 2 and quantized_outs:
        return QUANTIZED[op.opcode]
    if op.opcode in DIRECT and quantized_outs and _same_params([ctx.inputs[0]] + quantized_outs) \
            and (op.opcode != "CONCATENATION" or _same_params(quantized_ins + quantized_outs)):
        return None  # the float kernel moves the integers as they are
    float_kernel = KERNELS.get(op.opcode)
    if float_kernel is None:
        raise KernelError(f"no kernel for opcode {op.opcode}")
    return _generic(float_kernel)


@kernel("QUANTIZE")
def _quantize(op, inputs, ctx):
    x, out = inputs[0], ctx.outputs[0]
    src = ctx.inputs[0] if ctx.inputs else None
    if x.is_floating_point():
        return [quantize(x, out)]
    # requantize: TFLite Requantize, effective scale s_in / s_out
    real = float(np.float64(src.quant.scale[0])) / float(np.float64(out.quant.scale[0]))
    m, e = _multipliers([real])
    y = multiply_by_quantized_multiplier(x.to(torch.int64) - int(src.quant.zero_point[0]), m[0], e[0])
    lo, hi = _RANGE[out.torch_dtype]
    return [(y + int(out.quant.zero_point[0])).clamp(lo, hi).to(out.torch_dtype)]


def _dequantize(op, inputs, ctx):
    # (the float16 -> float32 DEQUANTIZE is elementwise's CAST kernel)
    return [dequantize(inputs[0], ctx.inputs[0]).to(ctx.out_dtype())]
