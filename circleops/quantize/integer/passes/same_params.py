"""Requantize the inputs of ops whose kernel takes only inputs with the output's parameters
(TFLite's int8 CONCATENATION; TargetProfile.quantized_same_params).

BEFORE:  y(int8, s_y) = CONCATENATION(a(int8, s_a), b(int8, s_y))
AFTER:   a2(int8, s_y) = QUANTIZE(a); y(int8, s_y) = CONCATENATION(a2, b)

What the kernel would otherwise do itself (the fake-quantized module's cat rounds once, at
its output: the same values).
"""
from __future__ import annotations

from circleops import ir
from circleops.quantize.integer.graph import Graph, same


def same_params(g: Graph, opcodes: frozenset[str]) -> None:
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        out = g.tensor(op.outputs[0]) if op.outputs else None
        if op.opcode in opcodes and out is not None and out.quant is not None:
            for pos, i in enumerate(op.inputs):
                t = g.tensor(i)
                if i < 0 or t.quant is None or (t.dtype == out.dtype and same(t.quant, out.quant)):
                    continue
                r = sg.add_tensor(ir.Tensor(f"{t.name}_requantized", t.shape, out.dtype, None, out.quant))
                new_ops.append(ir.Operator("QUANTIZE", [i], [r]))
                op.inputs[pos] = r
        new_ops.append(op)
    sg.operators = new_ops
    g.refresh()
