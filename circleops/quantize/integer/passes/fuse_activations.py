"""Fold an integer RELU / RELU6 into the op before it.

BEFORE:  a(uint8, s, zp) = ADD(x, y); b(uint8, s, zp) = RELU(a)
AFTER:   b(uint8, s, zp) = ADD(x, y, fusedActivationFunction=RELU)

When the RELU's input is the sole output of a conv / FC / ADD / SUB / MUL with the same
parameters and no activation of its own: one op fewer, and onert has no integer RELU
("ElementwiseActivationLayer(ReLU): unsupported data type", measured).
"""
from __future__ import annotations

from circleops.quantize.integer.graph import Graph, same

# integer ops that take a fusedActivationFunction; RELU / RELU6 after them fold into it
FUSES_ACTIVATION = frozenset({"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "ADD", "SUB", "MUL"})
ACTIVATION_CODE = {"RELU": 1, "RELU6": 3}


def fuse_activations(g: Graph) -> None:
    sg = g.sg
    drop = set()
    for k, op in enumerate(sg.operators):
        if op.opcode not in ACTIVATION_CODE or not g.quant(op.inputs[0]):
            continue
        i, o = op.inputs[0], op.outputs[0]
        p = g.producer.get(i)
        if p is None or i in sg.outputs or len(g.consumers.get(i, [])) != 1:
            continue
        prod = sg.operators[p]
        if prod.opcode not in FUSES_ACTIVATION or prod.options.get("fusedActivationFunction", 0) not in (0, "NONE") \
                or not same(g.tensor(i).quant, g.tensor(o).quant) or g.tensor(i).dtype != g.tensor(o).dtype:
            continue
        prod.options["fusedActivationFunction"] = ACTIVATION_CODE[op.opcode]
        if prod.options_type is None:
            prod.options_type = {"ADD": "AddOptions", "SUB": "SubOptions", "MUL": "MulOptions"}.get(prod.opcode)
        prod.outputs = [o if t == i else t for t in prod.outputs]
        drop.add(k)
    sg.operators = [op for k, op in enumerate(sg.operators) if k not in drop]
    g.refresh()
