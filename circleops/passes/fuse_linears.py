"""ir.Model pass: sibling linears (FULLY_CONNECTED ops reading the same input) become one
FULLY_CONNECTED over their weights' rows concatenated, then a SPLIT of its output.

Why: onert 0.1.0 runs every FULLY_CONNECTED with a GGML weight as its own ggml graph
(``ggml_graph_plan`` + ``ggml_graph_compute`` per call), which starts NUM_THREADS-1 worker
threads each time: ~66 µs per call at NUM_THREADS=2, and a SmolLM2 decode step made 211 such
calls (30 layers x q, k, v, o, gate, up, down + lm_head). Fusing q/k/v (3 -> 1) and
gate/up (2 -> 1) per layer leaves 121 (bench/README.md, "bench/ggml.py").

GGML_Q4_0 / GGML_Q8_0 blocks run along K within one row, and onert quantizes the input to
Q8_0 per input row, so the fused weight is the byte concatenation of the parts' blocks and
the result equals the separate products bit for bit. A float weight is fused by copying
it (memory during convert), so which dtypes to fuse is the caller's choice.

A group is fused only when every member is the same kind of linear (FULLY_CONNECTED with an
[N, K] weight, or target onert's 1x1 CONV_2D with an [N, 1, 1, K] filter) with the same
options and no fused activation; reads the same input tensor (or a RESHAPE of the same tensor
to the same shape); has a constant weight of the same dtype and K that no other op reads (a
tied weight keeps its one buffer); has a constant bias (concatenated too) or none, all alike;
writes an output of the same leading shape. The output is split along its last axis: SPLIT
for equal parts, one STRIDED_SLICE per part otherwise (onert 0.1.0's SPLIT_V returns wrong
values: targets.ONERT lists it as missing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from circleops import ir

# the default weight types of fuse_sibling_linears: GGML blocks (the schema types ir knows the blocks of)
GGML_DTYPES = frozenset(ir.GGML_BLOCKS)


@dataclass
class FusedLinears:
    """What ``fuse_sibling_linears`` did: one entry per fused weight, the parts' names."""

    groups: list[tuple[str, list[str]]] = field(default_factory=list)  # fused name, part names

    @property
    def removed(self) -> int:
        """Linear ops (FULLY_CONNECTED or CONV_2D) the fusion removed."""
        return sum(len(parts) - 1 for _, parts in self.groups)


def fuse_for_target(model: ir.Model, target: Any, cache: dict[tuple, Any] | None = None) -> FusedLinears:
    """Fuse what ``target`` (a name or circleops.targets.TargetProfile) asks for: the linears
    whose weight dtype is in its ``fuse_linear_dtypes``, split by SPLIT_V where it runs it."""
    from circleops.targets import profile

    p = profile(target)
    if not p.fuse_linear_dtypes:
        return FusedLinears()
    return fuse_sibling_linears(model, p.fuse_linear_dtypes, split_v=p.fuse_split_v and p.runs("SPLIT_V"),
                                cache=cache)


def fuse_sibling_linears(model: ir.Model, dtypes: Iterable[str] = GGML_DTYPES, *, split_v: bool = False,
                         cache: dict[tuple, Any] | None = None) -> FusedLinears:
    """Fuse sibling linears (FULLY_CONNECTED, 1x1 CONV_2D) of ``model`` in place (see the module docstring).

    dtypes: weight dtypes (schema TensorType names) whose linears may be fused.
    split_v: unequal parts may be split by one SPLIT_V (a runtime that runs it right)
        instead of one STRIDED_SLICE per part.
    cache: shares fused weights between models that hold the same weights (the prefill and
        decode graphs), so each concatenation is made once.
    """
    report = FusedLinears()
    dtypes = frozenset(dtypes)
    cache = cache if cache is not None else {}
    for si, sg in enumerate(model.subgraphs):
        if not _fuse_subgraph(sg, dtypes, split_v, cache, report):
            continue
        ir.prune_subgraph(model, si)  # the parts' weights
    return report


def _act(op: ir.Operator) -> int:
    act = op.options.get("fusedActivationFunction", 0) or 0
    return 0 if isinstance(act, str) and act.upper() == "NONE" else (1 if isinstance(act, str) else int(act))


def _same_reshapes(sg: ir.Subgraph) -> dict[int, int]:
    """RESHAPE output -> the first RESHAPE output of the same tensor to the same shape: the
    GGML pass gives each linear of a [1, 1, rows, K] input its own RESHAPE to [rows, K]."""
    first: dict[tuple, int] = {}
    same: dict[int, int] = {}
    for op in sg.operators:
        if op.opcode == "RESHAPE" and len(op.outputs) == 1:
            out = sg.tensors[op.outputs[0]]
            same[op.outputs[0]] = first.setdefault((op.inputs[0], tuple(out.shape), out.dtype), op.outputs[0])
    return same


def _candidate(sg: ir.Subgraph, op: ir.Operator, dtypes: frozenset[str], readers: dict[int, int]) -> tuple | None:
    """The group key (input, opcode, options, dtype, K, leading output shape, bias dtype) of a
    fusable linear: a FULLY_CONNECTED with a [N, K] weight, or a 1x1 stride-1 CONV_2D with an
    [N, 1, 1, K] filter (target onert's multi-row linear)."""
    if op.opcode not in ("FULLY_CONNECTED", "CONV_2D") or len(op.inputs) < 2 or len(op.outputs) != 1:
        return None
    if _act(op) or int(op.options.get("weightsFormat", 0) or 0):
        return None
    x, wi = op.inputs[0], op.inputs[1]
    w, out = sg.tensors[wi], sg.tensors[op.outputs[0]]
    if w.data is None or w.dtype not in dtypes or readers.get(wi, 0) != 1:
        return None
    quant = _weight_quant_key(sg, op, w)
    if quant is None:
        return None
    if op.opcode == "CONV_2D":
        ones = all(int(op.options.get(k, 1) or 1) == 1
                   for k in ("strideW", "strideH", "dilationWFactor", "dilationHFactor"))
        if len(w.shape) != 4 or tuple(w.shape[1:3]) != (1, 1) or not ones:
            return None
    elif len(w.shape) != 2:
        return None
    bias = op.inputs[2] if len(op.inputs) > 2 else -1
    if bias >= 0 and (sg.tensors[bias].data is None or sg.tensors[bias].quant is not None):
        return None
    if not out.shape or out.shape[-1] != w.shape[0]:
        return None
    return (x, op.opcode, repr(sorted(op.options.items())), w.dtype, w.shape[-1], tuple(out.shape[:-1]), out.dtype,
            sg.tensors[bias].dtype if bias >= 0 else None, quant)


def _weight_quant_key(sg: ir.Subgraph, op: ir.Operator, w: ir.Tensor) -> tuple | None:
    """What a fused weight's quantization must share, () for a plain weight; None when the
    linear cannot be fused: only a hybrid linear (float input and output) whose weight has
    one scale per output row (per channel along dimension 0, zero points 0) or per row and
    block (Blockwise: scales [N, K / B]) qualifies, since then each output row depends on its
    own weight row and scales alone and the rows concatenate. An integer linear's output
    parameters are its own, so it stays apart."""
    q = w.quant
    if q is None:
        return ()
    io = [sg.tensors[op.inputs[0]], sg.tensors[op.outputs[0]]]
    if any(t.quant is not None or not t.dtype.startswith("FLOAT") for t in io) or q.quantized_dimension != 0:
        return None
    if np.any(np.asarray(q.zero_point) != 0):
        return None
    if q.blockwise is not None:
        s = q.blockwise.scales
        return ("blockwise", q.blockwise.block_size, s.dtype) if s.data is not None else None
    return ("per-channel",) if len(q.scale) == w.shape[0] else None


def _fuse_subgraph(sg: ir.Subgraph, dtypes: frozenset[str], split_v: bool, cache: dict, report: FusedLinears) -> bool:
    readers: dict[int, int] = {}
    for op in sg.operators:
        for i in op.inputs:
            if i >= 0:
                readers[i] = readers.get(i, 0) + 1
    groups: dict[tuple, list[int]] = {}
    same = _same_reshapes(sg)
    for k, op in enumerate(sg.operators):
        key = _candidate(sg, op, dtypes, readers)
        if key is not None:
            x = same.get(key[0], key[0])
            groups.setdefault((x, *key[1:]), []).append(k)
    groups = {key: members for key, members in groups.items() if len(members) > 1}
    if not groups:
        return False
    replace: dict[int, list[ir.Operator]] = {}  # first member's position -> the fused ops
    dropped: set[int] = set()
    for (x, *_), members in groups.items():
        ops = [sg.operators[k] for k in members]
        replace[members[0]] = _fuse(sg, x, ops, split_v, cache, report)
        dropped.update(members[1:])
    new_ops: list[ir.Operator] = []
    for k, op in enumerate(sg.operators):
        if k in replace:
            new_ops.extend(replace[k])  # every output is written earlier than before: still in order
        elif k not in dropped:
            new_ops.append(op)
    sg.operators = new_ops
    return True


def _fuse(sg: ir.Subgraph, x: int, ops: list[ir.Operator], split_v: bool, cache: dict,
          report: FusedLinears) -> list[ir.Operator]:
    weights = [sg.tensors[op.inputs[1]] for op in ops]
    outs = [op.outputs[0] for op in ops]
    sizes = [w.shape[0] for w in weights]
    names = [w.name for w in weights]
    name = fused_name(names)
    report.groups.append((name, names))
    w0, out0 = weights[0], sg.tensors[outs[0]]
    wi = sg.add_tensor(ir.Tensor(name, (sum(sizes), *w0.shape[1:]), w0.dtype, _concat(weights, cache),
                                 _concat_quant(name, weights, cache)))
    y = sg.add_tensor(ir.Tensor(f"{out0.name}_fused", (*out0.shape[:-1], sum(sizes)), out0.dtype))
    bias = -1
    if len(ops[0].inputs) > 2 and ops[0].inputs[2] >= 0:
        biases = [sg.tensors[op.inputs[2]] for op in ops]
        bias = sg.add_tensor(ir.Tensor(f"{name}_bias", (sum(sizes),), biases[0].dtype, _concat(biases, cache)))
    fc = ir.Operator(ops[0].opcode, [x, wi, bias], [y], ops[0].options_type, dict(ops[0].options), ops[0].version)
    rank = len(out0.shape)

    def i32(label: str, values: list[int]) -> int:
        return sg.add_tensor(ir.Tensor(f"{out0.name}_{label}", (len(values),), "INT32",
                                       np.array(values, dtype=np.int32)))

    if len(set(sizes)) == 1:
        split = ir.Operator("SPLIT", [i32("split_axis", [rank - 1]), y], outs, "SplitOptions",
                            {"numSplits": len(outs)})
        return [fc, split]
    if split_v:
        split = ir.Operator("SPLIT_V", [y, i32("split_sizes", sizes), i32("split_axis", [rank - 1])], outs,
                            "SplitVOptions", {"numSplits": len(outs)})
        return [fc, split]
    slices, start = [], 0
    for out, n in zip(outs, sizes):
        begin, end = [0] * rank, list(sg.tensors[out].shape)
        begin[-1], end[-1] = start, start + n
        slices.append(ir.Operator("STRIDED_SLICE", [y, i32(f"begin{start}", begin), i32(f"end{start}", end),
                                                    i32("strides", [1] * rank)], [out], "StridedSliceOptions", {}))
        start += n
    return [fc, *slices]


def fused_name(names: list[str]) -> str:
    """The parts' names in one: ``layers.0.mlp.{gate,up}_proj.weight``."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    middles = [n[len(prefix):len(n) - len(suffix)] for n in names]
    if not all(middles):
        return "+".join(names)
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def _concat_quant(name: str, weights: list[ir.Tensor], cache: dict) -> ir.QuantParams | None:
    """The fused weight's quantization: the parts' per-row scales (and block scales) one
    after the other (:func:`_weight_quant_key` checked they are per row and alike)."""
    q0 = weights[0].quant
    if q0 is None:
        return None
    scale = np.concatenate([np.asarray(w.quant.scale, np.float32).reshape(-1) for w in weights])
    zero = np.zeros(scale.shape, np.int64)
    blockwise = None
    if q0.blockwise is not None:
        parts = [w.quant.blockwise.scales for w in weights]
        data = _concat(parts, cache)
        blockwise = ir.Blockwise(q0.blockwise.block_size,
                                 ir.Tensor(f"{name}_scales", tuple(data.shape), parts[0].dtype, data))
    return ir.QuantParams(scale, zero, 0, blockwise)


def _key(data: Any) -> tuple:
    if isinstance(data, torch.Tensor):
        return "torch", data.data_ptr(), data.numel(), str(data.dtype)
    data = np.asarray(data)
    return "numpy", data.__array_interface__["data"][0], data.size, data.dtype.str


def _concat(weights: list[ir.Tensor], cache: dict) -> np.ndarray:
    """The weights' rows, one after the other: GGML data is each row's blocks in order, so
    the byte concatenation of the flat block arrays is the fused weight's."""
    key = tuple(_key(w.data) for w in weights)
    if key not in cache:
        if weights[0].is_block_quantized:
            data = np.concatenate([np.asarray(w.data).reshape(-1) for w in weights])
        else:
            parts = [w.data.detach().cpu().numpy() if isinstance(w.data, torch.Tensor) else np.asarray(w.data)
                     for w in weights]
            data = np.concatenate([p.reshape(w.shape) for p, w in zip(parts, weights)], axis=0)
        cache[key] = data
    return cache[key]
