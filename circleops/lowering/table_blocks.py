"""A large fp32 weight of a TFLite file as row blocks, so XNNPACK never packs it whole (issue 32).

LiteRT's XNNPACK weight cache (circleops.runtime.litert) packs each FULLY_CONNECTED weight
through one scratch buffer, allocated (and zero-filled) at the size of the largest packed
weight and kept until the model goes (tensorflow/lite/delegates/xnnpack/weight_cache.cc,
``WeightCacheBuilder::Reserve``). The process that builds the cache holds that buffer beside
the file pages the packing reads. A tied fp32 lm_head is by far the largest weight of an
LLM: the Gemma-3-1B shape's 262144 x 1152 table is 1.21 GB, and its `convert --target tflite
--verify` peaked at 6.36 GB = 1.59x its 4.0 GB of fp32 weights, where the scratch was 1.21 GB
of it (a 6-layer model of the same shape: 1.2 GB anonymous before any file page was read).

So a constant FLOAT32 [N, K] weight past :data:`BLOCK_BYTES`, read only by FULLY_CONNECTEDs
(as their weight) and GATHERs (as their table, axis 0), is stored as row blocks of at most
that size: the same bytes once in the file (each block a view of the weight's rows, so the
writer streams them and every graph of the file shares them), each FULLY_CONNECTED becomes
one per block and a CONCATENATION of their outputs along the last axis, and each GATHER one
per block of the ids clamped into it, the row of the block that holds it picked by
SELECT_V2 (ids outside every block clamp like any GATHER's would fail: the result is then
the last block's clamped row, where the single GATHER would have failed). Each logit is the
same dot product as before (one row's): on the test model (tests/generate/test_table_blocks.py)
LiteRT's and the reference interpreter's logits are bit-identical to the unsplit file's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from circleops import ir

BLOCK_BYTES = 256 << 20  # the largest weight XNNPACK packs whole: 256 MiB (a 1.21 GB table: 5 blocks)


def _rows(data: Any, start: int, stop: int) -> Any:
    """Rows start:stop of a constant's data, a view of the same memory."""
    return data[start:stop]


def _splittable(sg: ir.Subgraph, index: int) -> bool:
    uses = [(op, i) for op in sg.operators for i, t in enumerate(op.inputs) if t == index]
    if not uses or index in sg.outputs:
        return False
    fc = False
    for op, i in uses:
        if op.opcode == "FULLY_CONNECTED" and i == 1:
            bias = op.inputs[2] if len(op.inputs) > 2 else -1
            act = op.options.get("fusedActivationFunction", 0)
            if bias >= 0 or act not in (0, None, "NONE"):
                return False
            fc = True
        elif op.opcode == "GATHER" and i == 0 and not op.options.get("axis", 0) and not op.options.get("batchDims", 0):
            continue
        else:
            return False
    return fc


def split_large_weights(model: ir.Model, block_bytes: int | None = None) -> list[str]:
    """Each large fp32 lm_head-like weight of ``model`` as row blocks of at most
    ``block_bytes`` (default :data:`BLOCK_BYTES`; module docstring), in place; the names of
    the weights split."""
    block_bytes = block_bytes or BLOCK_BYTES
    done: list[str] = []
    for si, sg in enumerate(model.subgraphs):
        targets = [i for i, t in enumerate(sg.tensors)
                   if t.is_const and t.dtype == "FLOAT32" and len(t.shape) == 2 and t.nbytes > block_bytes
                   and _splittable(sg, i)]
        for index in targets:
            _split(sg, index, block_bytes)
            done.append(sg.tensors[index].name)
        if targets:
            ir.prune_subgraph(model, si)
    return sorted(set(done))


def _split(sg: ir.Subgraph, index: int, block_bytes: int) -> None:
    w = sg.tensors[index]
    n, k = w.shape
    rows = max(1, block_bytes // (4 * k))
    blocks = []
    for b, start in enumerate(range(0, n, rows)):
        stop = min(n, start + rows)
        blocks.append((start, stop, sg.add_tensor(ir.Tensor(f"{w.name}_rows{b}", (stop - start, k), "FLOAT32",
                                                            _rows(w.data, start, stop)))))
    ops: list[ir.Operator] = []
    for op in sg.operators:
        if index not in op.inputs:
            ops.append(op)
        elif op.opcode == "FULLY_CONNECTED":
            ops.extend(_fully_connected(sg, op, blocks))
        else:
            ops.extend(_gather(sg, op, blocks))
    sg.operators = ops


def _fully_connected(sg: ir.Subgraph, op: ir.Operator, blocks: list) -> list[ir.Operator]:
    out = sg.tensors[op.outputs[0]]
    parts, ops = [], []
    for b, (start, stop, wb) in enumerate(blocks):
        y = sg.add_tensor(ir.Tensor(f"{out.name}_rows{b}", (*out.shape[:-1], stop - start), out.dtype))
        ops.append(ir.Operator("FULLY_CONNECTED", [op.inputs[0], wb, -1], [y], op.options_type, dict(op.options),
                               op.version))
        parts.append(y)
    ops.append(ir.Operator("CONCATENATION", parts, list(op.outputs), "ConcatenationOptions",
                           {"axis": len(out.shape) - 1, "fusedActivationFunction": 0}))
    return ops


def _const(sg: ir.Subgraph, name: str, value: int, dtype: str) -> int:
    np_dtype = {"INT64": np.int64, "INT32": np.int32}[dtype]
    return sg.add_tensor(ir.Tensor(name, (), dtype, np.array(value, dtype=np_dtype)))


def _gather(sg: ir.Subgraph, op: ir.Operator, blocks: list) -> list[ir.Operator]:
    ids_i, out_i = op.inputs[1], op.outputs[0]
    ids, out = sg.tensors[ids_i], sg.tensors[out_i]
    name, shape, dtype = out.name, tuple(ids.shape), ids.dtype
    ops: list[ir.Operator] = []
    acc = -1
    zero = _const(sg, f"{name}_zero", 0, dtype)
    for b, (start, stop, wb) in enumerate(blocks):
        local = ids_i
        if start:
            local = sg.add_tensor(ir.Tensor(f"{name}_ids{b}", shape, dtype))
            ops.append(ir.Operator("SUB", [ids_i, _const(sg, f"{name}_start{b}", start, dtype)], [local],
                                   "SubOptions", {"fusedActivationFunction": 0}))
        low = sg.add_tensor(ir.Tensor(f"{name}_low{b}", shape, dtype))
        ops.append(ir.Operator("MAXIMUM", [local, zero], [low]))
        clamped = sg.add_tensor(ir.Tensor(f"{name}_clamped{b}", shape, dtype))
        ops.append(ir.Operator("MINIMUM", [low, _const(sg, f"{name}_last{b}", stop - start - 1, dtype)], [clamped]))
        last = b == len(blocks) - 1
        rows_out = out_i if last and acc < 0 else sg.add_tensor(ir.Tensor(f"{name}_rows{b}", tuple(out.shape),
                                                                          out.dtype))
        ops.append(ir.Operator("GATHER", [wb, clamped], [rows_out], op.options_type or "GatherOptions",
                               dict(op.options), op.version))
        if acc < 0:
            acc = rows_out
            continue
        inside = sg.add_tensor(ir.Tensor(f"{name}_in{b}", shape, "BOOL"))
        ops.append(ir.Operator("EQUAL", [local, clamped], [inside]))
        inside3 = sg.add_tensor(ir.Tensor(f"{name}_in{b}_3d", (*shape, 1), "BOOL"))
        shape_t = sg.add_tensor(ir.Tensor(f"{name}_in{b}_shape", (len(shape) + 1,), "INT32",
                                          np.array([*shape, 1], dtype=np.int32)))
        ops.append(ir.Operator("RESHAPE", [inside, shape_t], [inside3], "ReshapeOptions",
                               {"newShape": [*shape, 1]}))
        picked = out_i if last else sg.add_tensor(ir.Tensor(f"{name}_picked{b}", tuple(out.shape), out.dtype))
        ops.append(ir.Operator("SELECT_V2", [inside3, rows_out, acc], [picked]))
        acc = picked
    return ops
