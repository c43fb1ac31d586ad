"""The graph's edges: a DEQUANTIZE after each quantized output; with ``integer_io`` the
integer tensors are the file's inputs and outputs instead.

BEFORE:  x(f32) -> QUANTIZE -> xq(uint8) ... y(uint8)                  (outputs: y)
AFTER:   x(f32) -> QUANTIZE -> xq(uint8) ... y(uint8) -> DEQUANTIZE -> y_dequantized(f32)
         integer_io: xq(uint8) ... y(uint8)                              (inputs: xq, outputs: y)
"""
from __future__ import annotations

from circleops import ir
from circleops.quantize.integer.graph import FLOAT, Graph


def boundaries(model: ir.Model, sg: ir.Subgraph, integer_io: bool) -> None:
    g = Graph(sg)
    ops = list(sg.operators)
    # inputs: a float input quantized by a QUANTIZE (kept as such, or made the input itself)
    if integer_io:
        for k, i in enumerate(list(sg.inputs)):
            users = g.consumers.get(i, [])
            if len(users) == 1 and sg.operators[users[0][0]].opcode == "QUANTIZE" \
                    and g.tensor(i).dtype == FLOAT:
                q = sg.operators[users[0][0]]
                sg.inputs[k] = q.outputs[0]
                ops.remove(q)
    for k, o in enumerate(list(sg.outputs)):
        t = sg.tensors[o]
        if t.quant is None or integer_io:
            continue
        f = sg.add_tensor(ir.Tensor(f"{t.name}_dequantized", t.shape, FLOAT))
        ops.append(ir.Operator("DEQUANTIZE", [o], [f]))
        sg.outputs[k] = f
    sg.operators = ops
