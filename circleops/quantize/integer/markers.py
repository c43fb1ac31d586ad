"""Lowering of the Q/DQ markers (circleops.quantize.integer.qdq) of a converted PT2E program.

The graph is lowered as the float graph it computes; the markers say which tensors are
stored as integers:
* ``quantized(x, spec)``: a QUANTIZE whose output tensor has ``spec``'s dtype and
  QuantizationParameters (circleops.quantize.integer.lower folds it into x's producer). On the
  channels-last source of a transposed x, so NHWC convolutions keep no NCHW detour.
* ``dequantized(w_int, spec)``: the float constant scale · (w_int - zp), remembered in the
  plan so that the integer pass writes ``w_int`` back with its parameters.
"""
from __future__ import annotations

from circleops.lowering.context import const_value
from circleops.lowering.registry import lower
from circleops.quantize.integer import qdq
from circleops.quantize.integer.spilled import dequantized_table


def quantize_marker(ctx, x, spec: qdq.QSpec):
    """QUANTIZE(x) whose output tensor is stored as ``spec`` (per tensor)."""
    y = ctx.emit("QUANTIZE", [x], out_shape=x.shape, out_dtype=x.dtype)
    tensor = ctx.sg.tensors[y.index]
    tensor.dtype = spec.dtype
    tensor.quant = spec.params()
    return y


@lower(qdq.quantized)
def _(ctx, node, x, spec):
    if x.is_const:
        t = spec.fake_quant(x.const)
        spec.plan.remember(t, spec)
        return const_value(t, x.name)
    moved = ctx.transposed(x) if not spec.per_channel else None
    if moved is not None:
        src, perm = moved
        return ctx.transpose(quantize_marker(ctx, src, spec), perm)
    if spec.per_channel:
        raise ctx.unsupported("quantizes an activation per channel",
                              "Quantize activations per tensor (CircleQuantizer does).")
    return quantize_marker(ctx, x, spec)


@lower(qdq.dequantized)
def _(ctx, node, q, spec):
    if not q.is_const:
        raise ctx.unsupported("dequantizes a tensor computed at run time",
                              "Only constants (weights, biases) are stored quantized before an op.")
    t = dequantized_table(q.const, spec)  # a large table's float values in a temporary file, not in memory
    spec.plan.remember(t, spec, q.const)
    return const_value(t, q.name)
