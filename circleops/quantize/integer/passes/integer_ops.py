"""Make integer every op whose float tensors are all quantized now; leave the others float.

BEFORE:  y(int16, s_y) = FULLY_CONNECTED(x(int16, s_x), W(f32), b(f32))
AFTER:   y(int16, s_y) = FULLY_CONNECTED(x(int16, s_x), W(int8, s_w per row), b(int64, s_x·s_w))

An op with every live input and every output quantized (the fused ops' float positions
FUSED_FLOAT_INPUTS / _OUTPUTS aside) becomes integer: its constant inputs are quantized
(circleops.quantize.integer.constants). An op that only moves data and was observed with
other output parameters than its input's gets a QUANTIZE after it (TFLite requires equal
ones; onert copies the bytes). Any other op touching a quantized tensor stays float:

BEFORE:  y(uint8) = ABS(x(uint8))
AFTER:   xf(f32) = DEQUANTIZE(x); yf(f32) = ABS(xf); y(uint8) = QUANTIZE(yf)

unless the target's files are full-integer (tflite): then it is an error naming the op.
"""
from __future__ import annotations

from circleops import ir
from circleops.quantize.integer.constants import quantize_consts
from circleops.quantize.integer.graph import FLOAT, PASS_THROUGH, Graph, same
from circleops.quantize.integer.qdq import QuantPlan
from circleops.targets import TargetProfile, profile

# fused ops: input positions that stay float in the integer op (schema/ops.yaml `quantized`)
FUSED_FLOAT_INPUTS = {"ATTENTION": {7, 8, 9, 10}}
FUSED_FLOAT_OUTPUTS = {"ATTENTION": {1, 2}}


def float_only(op: ir.Operator, target: str | TargetProfile) -> bool:
    """An op the target's runtime has no integer kernel for."""
    p = profile(target)
    if op.opcode in p.quantized_float_only:
        return True
    return op.opcode == "MEAN" and p.quantized_mean_needs_keep_dims and not op.options.get("keepDims", False)


def integer_ops(g: Graph, plan: QuantPlan, target: str | TargetProfile = "circle") -> None:
    sg = g.sg
    new_ops: list[ir.Operator] = []
    for op in sg.operators:
        if op.opcode in ("QUANTIZE", "DEQUANTIZE"):
            new_ops.append(op)
            continue
        float_in = FUSED_FLOAT_INPUTS.get(op.opcode, set())
        float_out = FUSED_FLOAT_OUTPUTS.get(op.opcode, set())
        ins = [(pos, i) for pos, i in enumerate(op.inputs) if i >= 0 and pos not in float_in]
        outs = [(pos, o) for pos, o in enumerate(op.outputs) if pos not in float_out]
        touched = [i for _, i in ins] + [o for _, o in outs]
        if not any(g.quant(t) for t in touched):
            new_ops.append(op)
            continue
        live_float = [i for _, i in ins if g.tensor(i).dtype == FLOAT and g.tensor(i).data is None]
        outs_ok = all(g.quant(o) for _, o in outs)
        if not live_float and outs_ok and not float_only(op, target):
            quantize_consts(g, op, ins, plan, profile(target).quantized_int16_bias)
            new_ops.append(op)
            new_ops.extend(requantize_moved(g, op))
            continue
        # stays float: dequantize its integer inputs, quantize into its integer outputs
        float_island_allowed(g, op, target)
        for pos, i in ins:
            if g.quant(i):
                f = sg.add_tensor(ir.Tensor(f"{g.tensor(i).name}_dequantized", g.tensor(i).shape, FLOAT))
                new_ops.append(ir.Operator("DEQUANTIZE", [i], [f]))
                op.inputs[pos] = f
        after = []
        for pos, o in outs:
            if g.quant(o):
                f = sg.add_tensor(ir.Tensor(f"{g.tensor(o).name}_float", g.tensor(o).shape, FLOAT))
                op.outputs[pos] = f
                after.append(ir.Operator("QUANTIZE", [f], [o]))
        new_ops.append(op)
        new_ops.extend(after)
    sg.operators = new_ops
    g.refresh()


def float_island_allowed(g: Graph, op: ir.Operator, target: str | TargetProfile) -> None:
    """A target whose files are full-integer (TargetProfile.quantized_float_islands False:
    tflite) refuses an op that would stay float between a DEQUANTIZE and a QUANTIZE, naming
    the op and the target whose runtime runs it integer."""
    from circleops.errors import TargetError

    p = profile(target)
    if p.quantized_float_islands:
        return
    if op.opcode == "STABLEHLO_COMPOSITE":
        what = f"the fused op {op.options.get('name', '?')} ({p.runtime} has no integer composite)"
        hint = ("quantize the unfused model (fuse='none', what circleops.convert does for this target), or use "
                "target 'circle' for integer RMS_NORM / ROPE / ATTENTION builtins (the reference interpreter runs them)")
    else:
        what = f"{op.opcode} (CircleQuantizer gives it no integer form, or {p.runtime} has no integer kernel for it)"
        hint = ("use target 'circle', whose files may keep such an op float between a DEQUANTIZE and a QUANTIZE "
                "(the reference interpreter runs them), or rewrite that part of the model with ops of integer form")
    name = g.tensor(op.outputs[0]).name if op.outputs else "?"
    raise TargetError(f"target {p.name}: {what} would compute in float (output {name!r}), and a {p.name} integer "
                      f"file is integer throughout: {hint}")


def requantize_moved(g: Graph, op: ir.Operator) -> list[ir.Operator]:
    """An op that only moves data keeps its input's parameters (TFLite requires it; onert
    copies the bytes): an output observed with other parameters gets a QUANTIZE after it."""
    if op.opcode not in PASS_THROUGH or not g.quant(op.inputs[0]):
        return []
    src = g.tensor(op.inputs[0])
    after = []
    for pos, o in enumerate(op.outputs):
        out = g.tensor(o)
        if out.quant is not None and (out.dtype != src.dtype or not same(out.quant, src.quant)):
            moved = g.sg.add_tensor(ir.Tensor(f"{out.name}_moved", out.shape, src.dtype, None, src.quant))
            op.outputs[pos] = moved
            after.append(ir.Operator("QUANTIZE", [moved], [o]))
    return after
