"""An integer NEG becomes SUB(0, x) (TargetProfile.quantized_neg_raw).

BEFORE:  y(int16, s) = NEG(x(int16, s))
AFTER:   y(int16, s) = SUB(zero(int16, s, [0]), x)

A kernel that negates the stored values (TFLite: -q, parameters ignored) is wrong with a
zero point, and even with mirrored parameters it wraps at the type's lowest value
(-(-32768) is -32768 in int16), which LiteRT's kernels write whenever they saturate low
(their range is [-32768, 32767], PT2E's symmetric [-32767, 32767]): on SmolLM2 the
saturated keys of RoPE's rotate_half flipped sign (measured, 8.8 dB logits).
"""
from __future__ import annotations

import numpy as np

from circleops import ir
from circleops.quantize.integer.graph import Graph, quantize_array


def neg_as_sub(g: Graph) -> None:
    sg = g.sg
    for op in sg.operators:
        if op.opcode != "NEG" or not g.quant(op.inputs[0]) or not g.quant(op.outputs[0]):
            continue
        x = g.tensor(op.inputs[0])
        zero = quantize_array(np.zeros([1], np.float32), x.dtype, x.quant)
        z = sg.add_tensor(ir.Tensor(f"{x.name}_zero", [1], x.dtype, zero, x.quant))
        op.opcode, op.options_type, op.options = "SUB", "SubOptions", {"fusedActivationFunction": 0}
        op.inputs = [z, op.inputs[0]]
    g.refresh()
