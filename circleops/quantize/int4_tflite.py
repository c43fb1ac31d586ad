"""The int4 formats' pass over a lowered TFLite graph (``--quantize int4 / int4-b64 / int4-b128 /
int4-pc``, form BLOCKWISE; what LiteRT runs: circleops.quantize.int4).

* Every FULLY_CONNECTED with a constant float weight [N, K] keeps its op, inputs, bias and
  activation; its weight becomes INT4 with the format's blocks (FLOAT16 scales in a
  BlockwiseQuantization) or per channel. A K the block does not divide takes the largest
  multiple of 32 below the block that does (int4-b128 on SmolLM2's 576: 96); a K with no
  block of 32 (XNNPACK delegates no smaller one) falls back to int8 per channel, w8's
  dynamic-range form, and the summary says which and why.
* The output head (a tied lm_head, or lm_head.weight) is int8 per channel (measured:
  bench/int4_litert.py, docs/quantization.md), and a GATHER of the embedding table becomes
  an EMBEDDING_LOOKUP of the same INT8 tensor (one scale per row: the head's per-channel
  scales), which LiteRT dequantizes exactly; a tied table and head are one buffer.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from circleops import ir
from circleops.quantize import int4, int8, linears, topk_head, topk_head_tflite
from circleops.quantize.formats import WeightFormat

INT4_FC_VERSION = 13  # FULLY_CONNECTED with an INT4 filter (LiteRT 2.3.0 registers it)
INT8_FC_VERSION = 5  # the dynamic-range (hybrid) FULLY_CONNECTED with per-channel scales


# linears kept int8 per channel by choice, per format: parameter names containing one of these.
# The MLP's down projection (its input is the gate * up product, the widest-ranging activation
# of a Llama block): SmolLM2-135M's perplexity on the shipped text +8.32 % with every linear
# int4, +6.77 % with the 30 down projections int8 (torch emulation of the file's arithmetic,
# 8 windows of 256; bench/results/28-int4-quality.yaml), for 12 MB more file (0.19x fp32's)
EIGHT_BIT_LINEARS: dict[str, tuple[str, ...]] = {"int4": ("mlp.down_proj.",), "int4-topk": ("mlp.down_proj.",)}


def eight_bit_by_choice(name: str, fmt: WeightFormat) -> bool:
    """Whether the linear weight ``name`` is one the format keeps int8 (:data:`EIGHT_BIT_LINEARS`)."""
    return any(part in name for part in EIGHT_BIT_LINEARS.get(fmt.name, ()))


def linear_dtype(k: int, fmt: WeightFormat, name: str = "") -> str:
    """INT4 when a linear with inputs of length ``k`` takes the format's block and the format
    does not keep the weight ``name`` int8 (:data:`EIGHT_BIT_LINEARS`), else INT8."""
    if eight_bit_by_choice(name, fmt):
        return int4.FALLBACK
    return int4.DTYPE if int4.block_for(k, fmt.block_size or 0) is not None else int4.FALLBACK


def fallback_reason(k: int, fmt: WeightFormat) -> str:
    return (f"K={k} takes no int4 block of {fmt.block_size} or a multiple of 32 below it (XNNPACK's "
            "smallest): int8 per channel")


def weight_tensor(name: str, shape2d: tuple[int, int], packed: Any) -> ir.Tensor:
    """The file's tensor for ``packed`` (int4.Int4Weight or int8.Int8Weight)."""
    n = shape2d[0]
    zeros = np.zeros(n, np.int64)
    if isinstance(packed, int8.Int8Weight):
        return ir.Tensor(name, shape2d, "INT8", packed.q, ir.QuantParams(np.asarray(packed.scale, np.float32), zeros, 0))
    if packed.block == int4.PER_CHANNEL:
        return ir.Tensor(name, shape2d, "INT4", packed.q, ir.QuantParams(np.asarray(packed.scales, np.float32), zeros, 0))
    scales = ir.Tensor(f"{name}_scales", tuple(packed.scales.shape), "FLOAT16", packed.scales)
    # scale: ones (the schema takes no scale with BlockwiseQuantization; the reader reads ones)
    return ir.Tensor(name, shape2d, "INT4", packed.q,
                     ir.QuantParams(np.ones(n, np.float32), zeros, 0, ir.Blockwise(packed.block, scales)))


def rewrite_subgraph(sg: ir.Subgraph, q: Any, is_param: Callable[[str], bool], kept: dict[str, tuple]) -> None:
    """Rewrite ``sg``'s linears and embedding lookups in place (``q``: the weight pass's
    quantizer, circleops.quantize.weights; ``kept``: name -> (shape, why) of weights left float)."""
    converted: dict[tuple, int] = {}

    def tensor(index: int, shape2d: tuple[int, int], dtype: str, role: str, suffix: str = "") -> int:
        key = (index, dtype, shape2d)
        if key not in converted:
            t = sg.tensors[index]
            converted[key] = sg.add_tensor(weight_tensor(q.name(t) + suffix, shape2d,
                                                         q.blocks(t, shape2d, dtype, role)))
        return converted[key]

    new_ops: list[ir.Operator] = []
    for op in sg.operators:
        if op.opcode == "GATHER" and linears.is_table(sg, op, is_param):
            new_ops.extend(lookup(sg, op, q, tensor))
            continue
        lin = linears.linear_weight(sg, op)
        if lin is None or op.opcode != "FULLY_CONNECTED":
            linears.note_float_inputs(sg, op, is_param, kept)
            new_ops.append(op)
            continue
        n, k, wi = lin
        w = sg.tensors[wi]
        dtype = q.linear_dtype(w, k)
        if dtype == int4.FALLBACK and n == 1:  # one scale would read as onert's hybrid form
            kept[w.name] = ((n, k), "one output channel")
            new_ops.append(op)
            continue
        if dtype == int4.FALLBACK and not q.is_head(w) and not eight_bit_by_choice(q.name(w), q.format):
            q.report.fallbacks[q.name(w)] = ((n, k), fallback_reason(k, q.format))
        top = q.format.head_topk
        if dtype == int4.FALLBACK and q.is_head(w) and topk_head.applies(n, top) and _plain(sg, op):
            # the two-stage head: every logit from an INT4 copy, the k best from the INT8 rows
            head4 = tensor(wi, (n, k), int4.DTYPE, topk_head.HEAD_ROLE, "_int4")
            q.report.two_stage[q.name(w)] = top
            new_ops.extend(topk_head_tflite.head_ops(sg, op, head4, tensor(wi, (n, k), dtype, "linear"), top))
            continue
        version = INT4_FC_VERSION if dtype == int4.DTYPE else INT8_FC_VERSION
        new_ops.append(ir.Operator(op.opcode, [op.inputs[0], tensor(wi, (n, k), dtype, "linear"), *op.inputs[2:]],
                                   list(op.outputs), op.options_type, dict(op.options), max(op.version, version)))
    sg.operators = new_ops


def _plain(sg: ir.Subgraph, op: ir.Operator) -> bool:
    """Whether the FULLY_CONNECTED ``op`` has no bias and no fused activation (a head does not)."""
    bias = op.inputs[2] if len(op.inputs) > 2 else -1
    act = op.options.get("fusedActivationFunction", 0) or 0
    return bias < 0 and (act == 0 or str(act).upper() == "NONE")


def lookup(sg: ir.Subgraph, op: ir.Operator, q: Any, tensor: Callable) -> list[ir.Operator]:
    """GATHER(table, ids) as EMBEDDING_LOOKUP(1-D int32 ids, the quantized table) -> [ids, H]:
    LiteRT's GATHER of a quantized table returns its integers, EMBEDDING_LOOKUP the dequantized
    rows (measured), and it takes only 1-D ids."""
    table_i, idx_i = op.inputs[0], op.inputs[1]
    t, idx, out = sg.tensors[table_i], sg.tensors[idx_i], sg.tensors[op.outputs[0]]
    q.report.embedding = q.report.embedding or q.name(t)
    ti = tensor(table_i, tuple(t.shape), q.format.table_type or q.dtype, "table")
    ops: list[ir.Operator] = []
    count = int(np.prod(idx.shape, dtype=np.int64))
    if idx.data is not None:
        ids = sg.add_tensor(ir.Tensor(f"{idx.name}_i32", (count,), "INT32",
                                      weights_numpy(idx.data).astype(np.int32).reshape(-1)))
    else:
        ids = idx_i
        if idx.dtype != "INT32":
            ids = sg.add_tensor(ir.Tensor(f"{idx.name}_i32", tuple(idx.shape), "INT32"))
            ops.append(ir.Operator("CAST", [idx_i], [ids], "CastOptions",
                                   {"inDataType": idx.dtype, "outDataType": "INT32"}))
        if len(idx.shape) != 1:
            ops.append(_reshape(sg, ids, (count,)))
            ids = ops[-1].outputs[0]
    rows = (count, int(t.shape[1]))
    if tuple(out.shape) == rows:
        ops.append(ir.Operator("EMBEDDING_LOOKUP", [ids, ti], list(op.outputs)))
        return ops
    flat = sg.add_tensor(ir.Tensor(f"{out.name}_rows", rows, "FLOAT32"))
    ops.append(ir.Operator("EMBEDDING_LOOKUP", [ids, ti], [flat]))
    ops.append(_reshape(sg, flat, tuple(out.shape), op.outputs[0]))
    return ops


def head_model(table: int8.Int8Weight, head4: int4.Int4Weight | None, k: int, rows: int = 1) -> ir.Model:
    """A one-head file: x [rows, H] -> logits [rows, V], the INT8 head as int4 ships it
    (``head4`` None) or the two-stage head with ``k`` candidates (bench/int4_head.py measures
    its ops; the tests check its arithmetic)."""
    v, h = table.q.shape
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, h), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("logits", (rows, v), "FLOAT32"))
    w8 = sg.add_tensor(weight_tensor("table", (v, h), table))
    fc = ir.Operator("FULLY_CONNECTED", [x, w8, -1], [y], "FullyConnectedOptions",
                     {"fusedActivationFunction": 0, "keepNumDims": False}, 5)
    if head4 is None:
        sg.operators.append(fc)
    else:
        w4 = sg.add_tensor(weight_tensor("table_int4", (v, h), head4))
        sg.operators.extend(topk_head_tflite.head_ops(sg, fc, w4, w8, k))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])


def _reshape(sg: ir.Subgraph, src: int, shape: tuple[int, ...], out: int | None = None) -> ir.Operator:
    s = sg.tensors[src]
    shape_t = sg.add_tensor(ir.Tensor(f"{s.name}_shape{len(sg.tensors)}", (len(shape),), "INT32",
                                      np.array(shape, dtype=np.int32)))
    if out is None:
        out = sg.add_tensor(ir.Tensor(f"{s.name}_flat", tuple(shape), s.dtype))
    return ir.Operator("RESHAPE", [src, shape_t], [out], "ReshapeOptions", {"newShape": list(shape)})


def weights_numpy(data: Any) -> np.ndarray:
    return data.detach().cpu().numpy() if hasattr(data, "detach") else np.asarray(data)


def summary_lines(report: Any) -> list[str]:
    """The convert summary of an int4 format's QuantReport (circleops.quantize.weights)."""
    from collections import Counter

    fmt = report.format_entry
    kinds = Counter(w.dtype for w in report.weights)
    block = fmt.block_size
    what = "one scale per output channel" if block == int4.PER_CHANNEL else f"blocks of {block} (FLOAT16 scales)"
    chosen = [w for w in report.weights if w.dtype == int4.FALLBACK and eight_bit_by_choice(w.name, fmt)]
    head = [w for w in report.weights if w.dtype == int4.FALLBACK and w.name not in report.fallbacks
            and w not in chosen]
    lines = [f"{kinds.get(int4.DTYPE, 0)} weights as INT4, {what}, {kinds.get(int4.FALLBACK, 0)} as INT8 per "
             f"channel ({report.fp32_bytes / 1e6:.1f} MB fp32 -> {report.ggml_bytes / 1e6:.1f} MB); activations "
             "quantized to int8 per row at run time (LiteRT's XNNPACK)"]
    odd = sorted({w.shape[1] for w in report.weights if w.dtype == int4.DTYPE and block
                  and w.shape[1] % block})
    if odd:
        lines.append("smaller blocks where the width needs them: " + ", ".join(
            f"K={k} in blocks of {int4.block_for(k, block)}" for k in odd))
    if head:
        lines.append("the output head (lm_head) and embedding as INT8 per row, one shared table (EMBEDDING_LOOKUP): "
                     + ", ".join(f"{w.name} {list(w.shape)}" for w in head))
    for name, k in report.two_stage.items():
        lines.append(f"the output head two-stage: {name} as an INT4 copy in {what} for every "
                     f"logit, its {k} largest rescored with the INT8 table's rows (TOPK_V2, EMBEDDING_LOOKUP, "
                     "SCATTER_ND; circleops.quantize.topk_head)")
    if chosen:
        lines.append(f"{len(chosen)} weights kept INT8 per channel by measurement ("
                     f"{', '.join(EIGHT_BIT_LINEARS.get(fmt.name, ()))}: the MLP down projections, whose input ranges "
                     "widest): " + ", ".join(w.name for w in chosen[:2]) + (", ..." if len(chosen) > 2 else ""))
    for name, (shape, why) in report.fallbacks.items():
        lines.append(f"fell back: {name} {list(shape)} ({why})")
    return lines
