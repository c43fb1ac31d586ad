"""An int16 RSQRT read over several input ranges, their MINIMUM
(TargetProfile.quantized_rsqrt_ranges).

BEFORE:  r = RSQRT(x(int16, s))
AFTER:   r0 = RSQRT(x); x1(s/16) = QUANTIZE(x); r1 = RSQRT(x1); x2(s/256) = QUANTIZE(x); r2 = RSQRT(x2)
         m1 = MINIMUM(r0, r1); r = MINIMUM(m1, r2)

A kernel that interpolates a table over the input's whole quantized range (LiteRT: 512
segments) is far off in the lowest segments, where rsqrt is steep: with SmolLM2's norms
(mean squares up to 8e5 for one massive token, 20-100 for the others) it returned ~1.0 for
rsqrt(100) = 0.1 (measured). rsqrt is convex and decreasing, so each table's interpolation
and each saturated input err upwards, and the smallest is the one whose range fits the
value (its segment at least 1/16 of the range from zero: within ~0.04 %).
"""
from __future__ import annotations

import numpy as np

from circleops import ir
from circleops.quantize.integer.graph import Graph

RSQRT_RANGE_FACTOR = 16  # each further RSQRT reads a 16x narrower input range


def rsqrt_ranges(g: Graph, count: int) -> None:
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        x = g.tensor(op.inputs[0]) if op.opcode == "RSQRT" and op.inputs else None
        out = g.tensor(op.outputs[0]) if op.outputs else None
        if x is None or x.dtype != "INT16" or x.quant is None or out is None or out.quant is None \
                or out.dtype != "INT16":
            new_ops.append(op)
            continue
        o = op.outputs[0]
        op.outputs = [sg.add_tensor(ir.Tensor(f"{out.name}_range0", out.shape, out.dtype, None, out.quant))]
        results = [op.outputs[0]]
        new_ops.append(op)
        for k in range(1, count):
            narrow = ir.QuantParams((x.quant.scale / RSQRT_RANGE_FACTOR ** k).astype(np.float32),
                                    x.quant.zero_point.copy(), x.quant.quantized_dimension)
            xk = sg.add_tensor(ir.Tensor(f"{x.name}_range{k}", x.shape, x.dtype, None, narrow))
            rk = sg.add_tensor(ir.Tensor(f"{out.name}_range{k}", out.shape, out.dtype, None, out.quant))
            new_ops += [ir.Operator("QUANTIZE", [op.inputs[0]], [xk]), ir.Operator("RSQRT", [xk], [rk])]
            results.append(rk)
        acc = results[0]
        for k, r in enumerate(results[1:], 1):
            dst = o if k == len(results) - 1 else \
                sg.add_tensor(ir.Tensor(f"{out.name}_min{k}", out.shape, out.dtype, None, out.quant))
            new_ops.append(ir.Operator("MINIMUM", [acc, r], [dst]))
            acc = dst
    sg.operators = new_ops
    g.refresh()
