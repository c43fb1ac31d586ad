"""LOGISTIC / SOFTMAX / TANH write the kernels' fixed output parameters (TFLite checks them
at prepare; TargetProfile.quantized_fixed_outputs).

BEFORE:  y(int16, s_obs) = LOGISTIC(x)
AFTER:   t(int16, 1/32768) = LOGISTIC(x); y(int16, s_obs) = QUANTIZE(t)

An output the calibration observed with other parameters is the fixed-parameter result
requantized (one more rounding, under a step).
"""
from __future__ import annotations

import numpy as np

from circleops import ir
from circleops.quantize.integer.graph import FIXED_OUTPUT, Graph, same


def fixed_outputs(g: Graph) -> None:
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        new_ops.append(op)
        if op.opcode not in FIXED_OUTPUT or not g.quant(op.outputs[0]):
            continue
        out = g.tensor(op.outputs[0])
        fixed = FIXED_OUTPUT[op.opcode].get(out.dtype)
        if fixed is None:
            continue
        qp = ir.QuantParams(np.array([fixed[0]], np.float32), np.array([fixed[1]], np.int64), 0)
        if same(out.quant, qp):
            continue
        t = sg.add_tensor(ir.Tensor(f"{out.name}_fixed", out.shape, out.dtype, None, qp))
        new_ops.append(ir.Operator("QUANTIZE", [t], [op.outputs[0]]))
        op.outputs[0] = t
    sg.operators = new_ops
    g.refresh()
