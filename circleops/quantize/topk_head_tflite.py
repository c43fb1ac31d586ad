"""The two-stage output head as TFLite ops (circleops.quantize.topk_head says what and why).

One FULLY_CONNECTED ``x [.., H] -> out [.., V]`` over an INT8 head becomes

    approx [R, V]  = FULLY_CONNECTED(x, head INT4 blocks)          (XNNPACK's qd8-f32-qb4w)
    values, idx    = TOPK_V2(approx, k)                            [R, k], int32 [R, k]
    rows [R*k, H]  = EMBEDDING_LOOKUP(idx, the INT8 table)         (dequantized rows)
    exact [R, 1, k] = BATCH_MATMUL(x [R, 1, H], rows [R, k, H], adjY)
    out            = approx + SCATTER_ND(idx (+ r V), exact - values, [R V])

LiteRT 2.3.0 runs TOPK_V2, EMBEDDING_LOOKUP and SCATTER_ND on its builtin kernels (XNNPACK
delegates none of them), the products on XNNPACK (bench/topk_head.py measured their cost). The
indices are unique (a top-k), so SCATTER_ND's summing of repeated indices never applies.
"""
from __future__ import annotations

import numpy as np

from circleops import ir

INT4_FC_VERSION = 13  # FULLY_CONNECTED with an INT4 filter (LiteRT 2.3.0 registers it)


def _const(sg: ir.Subgraph, name: str, value: np.ndarray) -> int:
    return sg.add_tensor(ir.Tensor(f"{name}{len(sg.tensors)}", tuple(value.shape), "INT32", value))


def _new(sg: ir.Subgraph, name: str, shape: tuple[int, ...], dtype: str = "FLOAT32") -> int:
    return sg.add_tensor(ir.Tensor(f"{name}{len(sg.tensors)}", tuple(shape), dtype))


def _reshape(sg: ir.Subgraph, src: int, shape: tuple[int, ...], out: int | None = None) -> ir.Operator:
    s = sg.tensors[src]
    if out is None:
        out = _new(sg, f"{s.name}_r", shape, s.dtype)
    return ir.Operator("RESHAPE", [src, _const(sg, f"{s.name}_shape", np.array(shape, np.int32))], [out],
                       "ReshapeOptions", {"newShape": list(shape)})


def head_ops(sg: ir.Subgraph, op: ir.Operator, approx_weight: int, table: int, k: int) -> list[ir.Operator]:
    """The ops replacing the head ``op`` (a FULLY_CONNECTED without bias or activation: its input
    ``op.inputs[0]`` [.., H], its output ``op.outputs[0]`` [.., V]): ``approx_weight`` the INT4 copy
    of the head [V, H], ``table`` the INT8 table [V, H] with one scale per row, ``k`` candidates."""
    x_i, out_i = op.inputs[0], op.outputs[0]
    v, h = (int(d) for d in sg.tensors[approx_weight].shape)
    x = sg.tensors[x_i]
    rows = int(np.prod(x.shape, dtype=np.int64)) // h
    name = sg.tensors[out_i].name
    ops: list[ir.Operator] = []
    approx = _new(sg, f"{name}_approx", (rows, v))
    ops.append(ir.Operator("FULLY_CONNECTED", [x_i, approx_weight, -1], [approx], "FullyConnectedOptions",
                           {"fusedActivationFunction": 0, "keepNumDims": False}, INT4_FC_VERSION))
    values, idx = _new(sg, f"{name}_topv", (rows, k)), _new(sg, f"{name}_topi", (rows, k), "INT32")
    ops.append(ir.Operator("TOPK_V2", [approx, _const(sg, f"{name}_k", np.array(k, np.int32))], [values, idx],
                           "TopKV2Options", {}))
    ops.append(_reshape(sg, idx, (rows * k,)))
    looked = _new(sg, f"{name}_rows", (rows * k, h))
    ops.append(ir.Operator("EMBEDDING_LOOKUP", [ops[-1].outputs[0], table], [looked]))
    ops.append(_reshape(sg, looked, (rows, k, h)))
    cand = ops[-1].outputs[0]
    ops.append(_reshape(sg, x_i, (rows, 1, h)))
    x3 = ops[-1].outputs[0]
    exact3 = _new(sg, f"{name}_exact", (rows, 1, k))
    ops.append(ir.Operator("BATCH_MATMUL", [x3, cand], [exact3], "BatchMatMulOptions",
                           {"adjX": False, "adjY": True, "asymmetricQuantizeInputs": False}))
    ops.append(_reshape(sg, exact3, (rows, k)))
    delta = _new(sg, f"{name}_delta", (rows, k))
    ops.append(ir.Operator("SUB", [ops[-1].outputs[0], values], [delta], "SubOptions",
                           {"fusedActivationFunction": 0}))
    at = idx
    if rows > 1:  # row r's logits start at r V in the flat output
        at = _new(sg, f"{name}_flat_idx", (rows, k), "INT32")
        offsets = _const(sg, f"{name}_row_offsets", (np.arange(rows, dtype=np.int32) * v).reshape(rows, 1))
        ops.append(ir.Operator("ADD", [idx, offsets], [at], "AddOptions", {"fusedActivationFunction": 0}))
    ops.append(_reshape(sg, at, (rows, k, 1)))
    scattered = _new(sg, f"{name}_scattered", (rows * v,))
    ops.append(ir.Operator("SCATTER_ND", [ops[-1].outputs[0], delta,
                                          _const(sg, f"{name}_flat_shape", np.array([rows * v], np.int32))],
                           [scattered]))
    ops.append(_reshape(sg, approx, (rows * v,)))
    total = _new(sg, f"{name}_two_stage", (rows * v,))
    ops.append(ir.Operator("ADD", [ops[-1].outputs[0], scattered], [total], "AddOptions",
                           {"fusedActivationFunction": 0}))
    ops.append(_reshape(sg, total, tuple(sg.tensors[out_i].shape), out_i))
    return ops


def head_model(table: "int8.Int8Weight", head4: "int4.Int4Weight | None", k: int, rows: int = 1) -> ir.Model:
    """A one-head file: x [rows, H] -> logits [rows, V], the INT8 head as int4 ships it
    (``head4`` None) or the two-stage head with ``k`` candidates (bench/int4_head.py measures
    its ops; the tests check its arithmetic)."""
    from circleops.quantize import int4_tflite

    v, h = table.q.shape
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, h), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("logits", (rows, v), "FLOAT32"))
    w8 = sg.add_tensor(int4_tflite.weight_tensor("table", (v, h), table))
    fc = ir.Operator("FULLY_CONNECTED", [x, w8, -1], [y], "FullyConnectedOptions",
                     {"fusedActivationFunction": 0, "keepNumDims": False}, 5)
    if head4 is None:
        sg.operators.append(fc)
    else:
        w4 = sg.add_tensor(int4_tflite.weight_tensor("table_int4", (v, h), head4))
        sg.operators.extend(head_ops(sg, fc, w4, w8, k))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])
