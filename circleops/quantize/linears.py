"""Queries of a lowered graph the weight passes share (circleops.quantize.weights, .int4_tflite):
which operators are linears with a constant weight, which GATHERs read an embedding table,
which weights an op that is no linear reads as float."""
from __future__ import annotations

from typing import Callable

from circleops import ir


def is_f32_const(t: ir.Tensor) -> bool:
    return t.data is not None and t.dtype == "FLOAT32" and t.quant is None


def linear_weight(sg: ir.Subgraph, op: ir.Operator) -> tuple[int, int, int] | None:
    """(N, K, weight index) of a linear this pass can rewrite: an FC with a constant [N, K]
    weight, or a 1x1 stride-1 CONV_2D over a [1, 1, rows, K] input (onert's linear)."""
    if op.opcode == "FULLY_CONNECTED" and len(op.inputs) >= 2 and op.inputs[1] >= 0:
        w = sg.tensors[op.inputs[1]]
        x = sg.tensors[op.inputs[0]]
        if is_f32_const(w) and len(w.shape) == 2 and x.dtype == "FLOAT32":
            return w.shape[0], w.shape[1], op.inputs[1]
    if op.opcode == "CONV_2D" and len(op.inputs) >= 2:
        w, x = sg.tensors[op.inputs[1]], sg.tensors[op.inputs[0]]
        o = op.options
        ones = all(int(o.get(k, 1) or 1) == 1 for k in ("strideW", "strideH", "dilationWFactor", "dilationHFactor"))
        if (is_f32_const(w) and len(w.shape) == 4 and w.shape[1:3] == (1, 1) and len(x.shape) == 4
                and tuple(x.shape[:2]) == (1, 1) and ones and x.dtype == "FLOAT32"):
            return w.shape[0], w.shape[3], op.inputs[1]
    return None


def note_float_inputs(sg: ir.Subgraph, op: ir.Operator, is_param: Callable[[str], bool], kept: dict[str, tuple]) -> None:
    """Record in ``kept`` the weights an op that is no linear reads as float (a fused
    ATTENTION's, a composite's)."""
    if op.opcode == "ATTENTION":  # wq, wk, wv, wo: ONE's ATTENTION kernel reads float weights
        for i in op.inputs[1:5]:
            if i >= 0 and is_f32_const(sg.tensors[i]):
                kept[sg.tensors[i].name] = (tuple(sg.tensors[i].shape), "a weight of the fused ATTENTION op")
    elif op.opcode == "STABLEHLO_COMPOSITE":  # its decomposition reads these as float inputs
        for i in op.inputs:
            t = sg.tensors[i] if i >= 0 else None
            if t is not None and is_f32_const(t) and len(t.shape) == 2 and is_param(t.name):
                kept[t.name] = (tuple(t.shape), f"an input of the {op.options.get('name', 'composite')} "
                                                "composite (generation graphs write attention inline)")


def is_table(sg: ir.Subgraph, op: ir.Operator, is_param: Callable[[str], bool]) -> bool:
    """A GATHER of rows of a constant [V, H] model parameter: an embedding."""
    t = sg.tensors[op.inputs[0]]
    return (is_f32_const(t) and len(t.shape) == 2 and is_param(t.name)
            and int(op.options.get("axis", 0) or 0) == 0 and int(op.options.get("batchDims", 0) or 0) == 0)
