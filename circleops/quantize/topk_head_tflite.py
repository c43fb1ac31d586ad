"""The two-stage output head as TFLite ops (circleops.quantize.topk_head says what and why).

One FULLY_CONNECTED ``x [.., H] -> out [.., V]`` over an INT8 head becomes

    approx [.., V] = FULLY_CONNECTED(x, head INT4 blocks)          (XNNPACK's qd8-f32-qb4w)
    values, idx    = TOPK_V2(approx, k)                            [.., k], int32 [.., k]
                     (one row: in two levels, over the groups' maxima then the best groups)
    rows [R k, H]  = EMBEDDING_LOOKUP(idx, the INT8 table)         (dequantized rows)
    exact [.., k]  = FULLY_CONNECTED(x, rows)  (one row; R rows: BATCH_MATMUL with their own k rows)
    out            = approx + SCATTER_ND((row, idx), exact - values, out's shape)

LiteRT 2.3.0 runs TOPK_V2, EMBEDDING_LOOKUP and SCATTER_ND on its builtin kernels (XNNPACK
delegates none of them), the products on XNNPACK (bench/int4_head.py measured their cost). The
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


# logits per group of the two-level top-k: the k largest lie in the k groups of largest maxima
# (a group holding one of them has its maximum above every logit outside them, so fewer than k
# groups rank above it), so TOPK_V2 runs over V / GROUP maxima and k GROUP candidates instead of V
GROUP = 64


def _grouped_topk(sg: ir.Subgraph, ops: list[ir.Operator], approx: int, v: int, k: int, *, lead: tuple[int, ...],
                  name: str) -> tuple[int, int]:
    """(values, indices) [.., k] of the k largest of the one row ``approx`` [.., V]: TOPK_V2 of the
    groups' maxima, TOPK_V2 of the k best groups' logits, each index back to its column."""
    groups = v // GROUP
    ops.append(_reshape(sg, approx, (groups, GROUP)))
    grid = ops[-1].outputs[0]
    gmax = _new(sg, f"{name}_gmax", (groups,))
    ops.append(ir.Operator("REDUCE_MAX", [grid, _const(sg, f"{name}_axis", np.array([1], np.int32))],
                           [gmax], "ReducerOptions", {"keepDims": False}))
    kk = _const(sg, f"{name}_k", np.array(k, np.int32))
    gv, gi1 = _new(sg, f"{name}_gv", (k,)), _new(sg, f"{name}_gi", (k,), "INT32")
    ops.append(ir.Operator("TOPK_V2", [gmax, kk], [gv, gi1], "TopKV2Options", {}))
    cand = _new(sg, f"{name}_cand", (k, GROUP))
    ops.append(ir.Operator("GATHER", [grid, gi1], [cand], "GatherOptions", {"axis": 0, "batchDims": 0}))
    ops.append(_reshape(sg, cand, (1, k * GROUP)))
    cv, ci = _new(sg, f"{name}_topv", (1, k)), _new(sg, f"{name}_ci", (1, k), "INT32")
    ops.append(ir.Operator("TOPK_V2", [ops[-1].outputs[0], kk], [cv, ci], "TopKV2Options", {}))
    g = _const(sg, f"{name}_group", np.array(GROUP, np.int32))
    slot, within = _new(sg, f"{name}_slot", (1, k), "INT32"), _new(sg, f"{name}_within", (1, k), "INT32")
    ops.append(ir.Operator("FLOOR_DIV", [ci, g], [slot]))
    ops.append(ir.Operator("FLOOR_MOD", [ci, g], [within]))
    base = _new(sg, f"{name}_base", (1, k), "INT32")
    ops.append(ir.Operator("GATHER", [gi1, slot], [base], "GatherOptions", {"axis": 0, "batchDims": 0}))
    start = _new(sg, f"{name}_start", (1, k), "INT32")
    ops.append(ir.Operator("MUL", [base, g], [start], "MulOptions", {"fusedActivationFunction": 0}))
    idx = _new(sg, f"{name}_topi", (1, k), "INT32")
    ops.append(ir.Operator("ADD", [start, within], [idx], "AddOptions", {"fusedActivationFunction": 0}))
    if lead != (1,):
        ops.append(_reshape(sg, cv, (*lead, k)))
        cv = ops[-1].outputs[0]
        ops.append(_reshape(sg, idx, (*lead, k)))
        idx = ops[-1].outputs[0]
    return cv, idx


def head_ops(sg: ir.Subgraph, op: ir.Operator, approx_weight: int, table: int, k: int) -> list[ir.Operator]:
    """The ops replacing the head ``op`` (a FULLY_CONNECTED without bias or activation: its input
    ``op.inputs[0]`` [.., H], its output ``op.outputs[0]`` [.., V]): ``approx_weight`` the INT4 copy
    of the head [V, H], ``table`` the INT8 table [V, H] with one scale per row, ``k`` candidates.

    No op reshapes a [.., V] tensor (XNNPACK copies on a reshape): the 4-bit product writes the
    output's shape, SCATTER_ND writes into it by full coordinates and the ADD writes the output."""
    x_i, out_i = op.inputs[0], op.outputs[0]
    out_shape = tuple(int(d) for d in sg.tensors[out_i].shape)
    v, h = (int(d) for d in sg.tensors[approx_weight].shape)
    lead = out_shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    name = sg.tensors[out_i].name
    ops: list[ir.Operator] = []
    approx = _new(sg, f"{name}_approx", out_shape)
    ops.append(ir.Operator("FULLY_CONNECTED", [x_i, approx_weight, -1], [approx], "FullyConnectedOptions",
                           dict(op.options), INT4_FC_VERSION))
    if rows == 1 and v % GROUP == 0 and v // GROUP > k:
        values, idx = _grouped_topk(sg, ops, approx, v, k, lead=lead, name=name)
    else:
        values, idx = _new(sg, f"{name}_topv", (*lead, k)), _new(sg, f"{name}_topi", (*lead, k), "INT32")
        ops.append(ir.Operator("TOPK_V2", [approx, _const(sg, f"{name}_k", np.array(k, np.int32))], [values, idx],
                               "TopKV2Options", {}))
    ops.append(_reshape(sg, idx, (rows * k,)))
    looked = _new(sg, f"{name}_rows", (rows * k, h))
    ops.append(ir.Operator("EMBEDDING_LOOKUP", [ops[-1].outputs[0], table], [looked]))
    if rows == 1:  # one row (decode, prefill's logits row): a float product with the k rows as its filter
        exact2 = _new(sg, f"{name}_exact", (1, k))
        ops.append(ir.Operator("FULLY_CONNECTED", [x_i, looked, -1], [exact2], "FullyConnectedOptions",
                               {"fusedActivationFunction": 0, "keepNumDims": False}))
    else:  # each row against its own k rows
        ops.append(_reshape(sg, looked, (rows, k, h)))
        cand = ops[-1].outputs[0]
        ops.append(_reshape(sg, x_i, (rows, 1, h)))
        exact2 = _new(sg, f"{name}_exact", (rows, 1, k))
        ops.append(ir.Operator("BATCH_MATMUL", [ops[-1].outputs[0], cand], [exact2], "BatchMatMulOptions",
                               {"adjX": False, "adjY": True, "asymmetricQuantizeInputs": False}))
    ops.append(_reshape(sg, exact2, (*lead, k)))
    delta = _new(sg, f"{name}_delta", (*lead, k))
    ops.append(ir.Operator("SUB", [ops[-1].outputs[0], values], [delta], "SubOptions",
                           {"fusedActivationFunction": 0}))
    # SCATTER_ND's coordinates into the output's shape: each candidate's leading indices, then its column
    ops.append(_reshape(sg, idx, (*lead, k, 1)))
    at = ops[-1].outputs[0]
    if lead:
        grid = np.stack(np.meshgrid(*[np.arange(d, dtype=np.int32) for d in lead], indexing="ij"), -1)
        prefix = _const(sg, f"{name}_coords", np.ascontiguousarray(
            np.broadcast_to(grid[..., None, :], (*lead, k, len(lead)))))
        coords = _new(sg, f"{name}_at", (*lead, k, len(lead) + 1), "INT32")
        ops.append(ir.Operator("CONCATENATION", [prefix, at], [coords], "ConcatenationOptions",
                               {"axis": len(lead) + 1, "fusedActivationFunction": 0}))
        at = coords
    scattered = _new(sg, f"{name}_scattered", out_shape)
    ops.append(ir.Operator("SCATTER_ND", [at, delta, _const(sg, f"{name}_shape", np.array(out_shape, np.int32))],
                           [scattered]))
    ops.append(ir.Operator("ADD", [approx, scattered], [out_i], "AddOptions", {"fusedActivationFunction": 0}))
    return ops

