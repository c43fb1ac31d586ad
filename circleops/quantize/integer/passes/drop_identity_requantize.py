"""Drop a QUANTIZE that copies: integer to integer with the same dtype and parameters.

BEFORE:  a(int16, s) = OP(...); b(int16, s) = QUANTIZE(a); y = NEXT(b)
AFTER:   a(int16, s) = OP(...); y = NEXT(a)

Its readers read the source instead (two markers of one tensor leave one); a QUANTIZE
writing a graph output stays.
"""
from __future__ import annotations

from circleops.quantize.integer.graph import FLOAT, Graph, same


def drop_identity_requantize(g: Graph) -> None:
    sg = g.sg
    alias: dict[int, int] = {}
    kept = []
    for op in sg.operators:
        op.inputs = [alias.get(i, i) for i in op.inputs]
        if op.opcode == "QUANTIZE":
            src, dst = g.tensor(op.inputs[0]), g.tensor(op.outputs[0])
            if src.dtype == dst.dtype and src.dtype != FLOAT and same(src.quant, dst.quant) \
                    and op.outputs[0] not in sg.outputs:
                alias[op.outputs[0]] = op.inputs[0]
                continue
        kept.append(op)
    sg.operators = kept
    g.refresh()
