"""The constant inputs of an op that becomes integer (circleops.quantize.integer.passes.integer_ops):
weights with the parameters PT2E chose (or their per-group int4 integers), biases int32 (int64
where the target's int16 kernels read them so) with scale s_input · s_weight."""
from __future__ import annotations

from circleops import ir
from circleops.quantize.grouped import blockwise_params
from circleops.quantize.grouped import lookup as grouped_lookup
from circleops.quantize.integer.graph import FLOAT, NP, WEIGHTED, Graph, params_from_data, quantize_array
from circleops.quantize.integer.qdq import QuantPlan


def quantize_consts(g: Graph, op: ir.Operator, ins: list[tuple[int, int]], plan: QuantPlan,
                    int16_bias: str = "INT32") -> None:
    """Constant float inputs of an integer op become integer constants (the bias of an op
    on int16 activations as ``int16_bias``: TargetProfile.quantized_int16_bias)."""
    sg = g.sg
    act = next((g.tensor(i) for _, i in ins if g.quant(i) and g.tensor(i).data is None), None)
    act = act or g.tensor(op.outputs[0])
    for pos, i in ins:
        t = g.tensor(i)
        if t.data is None or t.dtype != FLOAT:
            continue
        hit = None
        if op.opcode in WEIGHTED and pos == 2:
            qp = bias_params(g, op, t)
            dtype = int16_bias if g.tensor(op.inputs[0]).dtype == "INT16" else "INT32"
        else:
            hit = plan.lookup(t.data)
            grouped = grouped_lookup(t.data) if hit is None else None  # FC weights, ATTENTION's wq..wo
            if grouped is not None:  # per-group int4 rounded before PT2E: the integers as they are
                values, dtype, qp = blockwise_params(t.name, grouped, t.data)
                op.inputs[pos] = sg.add_tensor(ir.Tensor(t.name, t.shape, dtype, values, qp))
                continue
            if hit is not None:
                spec, axis = hit
                qp, dtype = spec.params(axis), spec.dtype
            elif op.opcode in WEIGHTED and pos == 1:
                axis = 3 if op.opcode == "DEPTHWISE_CONV_2D" else 0
                qp, dtype = params_from_data(t.data, "INT8", axis), "INT8"
            else:
                dtype = act.dtype
                qp = params_from_data(t.data, dtype)
        values = plan.integers(t.data) if hit is not None else None
        if values is None or str(values.dtype) != str(NP[dtype]().dtype):
            values = quantize_array(t.data, dtype, qp)
        idx = sg.add_tensor(ir.Tensor(t.name, t.shape, dtype, values, qp))
        op.inputs[pos] = idx


def bias_params(g: Graph, op: ir.Operator, bias: ir.Tensor) -> ir.QuantParams:
    """int32 bias: scale = s_input · s_weight (per channel), zero point 0."""
    import numpy as np

    x, w = g.tensor(op.inputs[0]).quant, g.tensor(op.inputs[1]).quant
    scale = (np.float32(x.scale[0]) * w.scale.astype(np.float32)).astype(np.float32)
    if scale.size == 1 and bias.shape and bias.shape[0] > 1:
        scale = np.full(bias.shape[0], scale[0], np.float32)
    return ir.QuantParams(scale, np.zeros(scale.size, np.int64), 0)
