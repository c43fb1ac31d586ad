"""Give the lowering's own intermediates their neighbours' parameters.

BEFORE:  a(uint8, s, zp) = FULLY_CONNECTED(...); b(f32) = RESHAPE(a); c = LOGISTIC(q) -> c(f32)
AFTER:   a(uint8, s, zp) = FULLY_CONNECTED(...); b(uint8, s, zp) = RESHAPE(a); c(uint8, 1/256, 0)

Parameters flow through ops that only move data (PASS_THROUGH: RESHAPE, TRANSPOSE, slices,
GATHER, padding, max-pool), forwards, and backwards into a float tensor read only by such
ops (an FC's 2-D output before its reshape, a conv's NHWC output before its transpose).
LOGISTIC / TANH / SOFTMAX outputs the torch graph did not observe (the sigmoid inside silu)
get TFLite's fixed parameters (FIXED_OUTPUT). Repeated until nothing changes.
"""
from __future__ import annotations

import numpy as np

from circleops import ir
from circleops.quantize.integer.graph import FIXED_OUTPUT, FLOAT, INTEGER, PASS_THROUGH, Graph, assign


def propagate(g: Graph) -> None:
    sg = g.sg
    changed = True
    while changed:
        changed = False
        for op in sg.operators:
            if op.opcode in PASS_THROUGH and op.inputs and op.inputs[0] >= 0:
                d = op.inputs[0]
                din = g.tensor(d)
                if din.data is not None or din.dtype not in (FLOAT,) + INTEGER:
                    continue
                for o in op.outputs:
                    out = g.tensor(o)
                    # (an onert output copy was made from the marker's tensor: same dtype, no params)
                    if g.quant(d) and not g.quant(o) and out.dtype in (FLOAT, din.dtype):
                        assign(out, din)
                        changed = True
                    elif g.quant(o) and not g.quant(d) and din.dtype == FLOAT and d not in sg.inputs \
                            and d in g.producer and all(sg.operators[u].opcode in PASS_THROUGH and u_pos == 0
                                                        for u, u_pos in g.consumers.get(d, [])):
                        assign(din, out)
                        changed = True
            elif op.opcode in FIXED_OUTPUT and g.quant(op.inputs[0]) and not g.quant(op.outputs[0]):
                dtype = g.tensor(op.inputs[0]).dtype
                if dtype in FIXED_OUTPUT[op.opcode]:
                    scale, zp = FIXED_OUTPUT[op.opcode][dtype]
                    out = g.tensor(op.outputs[0])
                    out.dtype = dtype
                    out.quant = ir.QuantParams(np.array([scale], np.float32), np.array([zp], np.int64), 0)
                    changed = True
