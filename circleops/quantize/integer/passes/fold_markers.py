"""Fold each QUANTIZE marker into the op producing its input.

BEFORE:  x(f32) = OP(...); q(uint8, s, zp) = QUANTIZE(x); y = NEXT(q)
AFTER:   q(uint8, s, zp) = OP(...); y = NEXT(q)

The marker (circleops.quantize.integer.markers) names the parameters PT2E chose for x; the op
now writes the integer tensor directly. A constant's marker quantizes it in place (the
constant becomes q's data). Further markers of the same tensor read q instead of x (they
requantize from it).
"""
from __future__ import annotations

from circleops import ir
from circleops.quantize.integer.graph import FLOAT, Graph, quantize_array


def is_marker(g: Graph, op: ir.Operator) -> bool:
    """A QUANTIZE from a float tensor into a tensor with parameters."""
    return op.opcode == "QUANTIZE" and g.tensor(op.inputs[0]).dtype == FLOAT and g.quant(op.outputs[0])


def fold_markers(g: Graph) -> None:
    sg = g.sg
    drop: set[int] = set()
    for k, op in enumerate(sg.operators):
        if not is_marker(g, op):
            continue
        i, o = op.inputs[0], op.outputs[0]
        src, dst = g.tensor(i), g.tensor(o)
        if src.data is not None:  # a constant: quantized in place
            dst.data = quantize_array(src.data, dst.dtype, dst.quant)
            drop.add(k)
            continue
        p = g.producer.get(i)
        users = g.consumers.get(i, [])
        if p is None or i in sg.outputs or i in sg.inputs or src.quant is not None:
            continue
        if not all(is_marker(g, sg.operators[u]) for u, _ in users) or users[0][0] != k:
            continue
        # the producer writes the integer tensor; later markers of i requantize from it
        prod = sg.operators[p]
        prod.outputs = [o if t == i else t for t in prod.outputs]
        for u, pos in users[1:]:
            sg.operators[u].inputs[pos] = o
        drop.add(k)
    sg.operators = [op for k, op in enumerate(sg.operators) if k not in drop]
    g.refresh()
