"""RMSNorm op by op, int16: the mean square also computed at finer scales
(TargetProfile.quantized_mean_square_narrow).

BEFORE:  sq = MUL(x, x); ms = MEAN(sq); a = ADD(ms, eps); r = RSQRT(a)
AFTER:   sq = MUL(x, x); ms = MEAN(sq); a = ADD(ms, eps); r_c = RSQRT(a)
         sq_f(s_sq / factor) = MUL(x, x); ms_f(s_ms / factor) = MEAN(sq_f); r_f = RSQRT(ms_f)
         over = RELU(c - r_c); r = SUB(r_f, over)          c = rsqrt(the fine range's top)

One massive token sets the mean square's range (SmolLM2: 8e5, a step of 25) and the other
tokens' mean squares (10-100) get a few levels or none: their normalizer was off by up to
22 % in a one-norm file with such a token (tests/tflite/test_tflite_integer.py). The fine
mean square saturates above 1/factor of the range; where it did not, r_c is above c and r_f
stands; where it did, r_f is c and the result r_c.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from circleops import ir
from circleops.quantize.integer.graph import Graph, quantize_array, symmetric16


def narrow_mean_squares(g: Graph, factor: int) -> None:
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        new_ops.append(op)
        if op.opcode != "RSQRT":
            continue
        add = g.producer_op(op.inputs[0], "ADD")
        if add is None:
            continue
        live = [i for i in add.inputs if g.tensor(i).data is None]
        mean = g.producer_op(live[0], "MEAN") if len(live) == 1 else None
        mul = g.producer_op(mean.inputs[0], "MUL") if mean is not None else None
        if mul is None or mul.inputs[0] != mul.inputs[1] \
                or mul.options.get("fusedActivationFunction", 0) not in (0, "NONE"):
            continue
        sq, ms, r = (g.tensor(t) for t in (mul.outputs[0], mean.outputs[0], op.outputs[0]))
        if not all(symmetric16(t) for t in (g.tensor(mul.inputs[0]), sq, ms, g.tensor(add.outputs[0]), r)):
            continue

        def finer(t: ir.Tensor, name: str) -> int:
            q = ir.QuantParams((t.quant.scale / factor).astype(np.float32), t.quant.zero_point.copy(), 0)
            return sg.add_tensor(ir.Tensor(f"{t.name}_{name}", t.shape, t.dtype, None, q))

        def like_r(name: str, data: Any = None) -> int:
            return sg.add_tensor(ir.Tensor(f"{r.name}_{name}", [1] if data is not None else r.shape, r.dtype, data,
                                           r.quant))

        sq_f, ms_f = finer(sq, "fine"), finer(ms, "fine")
        r_f, r_c, over = like_r("fine"), like_r("coarse"), like_r("over")
        top = 32767.0 * float(ms.quant.scale[0]) / factor  # where the fine mean square saturates
        c = like_r("fine_top", quantize_array(np.array([top ** -0.5]), "INT16", r.quant))
        out = op.outputs[0]
        op.outputs = [r_c]
        new_ops += [ir.Operator("MUL", [mul.inputs[0], mul.inputs[0]], [sq_f], mul.options_type, dict(mul.options)),
                    ir.Operator("MEAN", [sq_f] + mean.inputs[1:], [ms_f], mean.options_type, dict(mean.options)),
                    ir.Operator("RSQRT", [ms_f], [r_f]),
                    ir.Operator("SUB", [c, r_c], [over], "SubOptions", {"fusedActivationFunction": 1}),  # RELU
                    ir.Operator("SUB", [r_f, over], [out], "SubOptions", {"fusedActivationFunction": 0})]
    sg.operators = new_ops
    g.refresh()
