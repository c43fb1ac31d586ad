"""Helpers for tests/tflite: convert once per session, run in LiteRT, read files with
LiteRT's own schema bindings (ai_edge_litert.schema_py_generated), independent of
circleops' reader.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rounding import cpu_flags  # /proc/cpuinfo, read here and not through circleops.runtime.host (tests stub it)

# LiteRT's kernels: with the default XNNPACK delegate, and the builtin kernels alone
# (what runs a composite's decomposition subgraph, and what a runtime without XNNPACK has).
RESOLVERS = ("xnnpack", "builtin")


def litert(path: str | Path, inputs: list[np.ndarray], resolver: str = "xnnpack") -> list[np.ndarray]:
    """Run ``path`` in LiteRT with the chosen kernels; outputs in subgraph order."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kind = {"xnnpack": OpResolverType.AUTO, "builtin": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES}[resolver]
    it = Interpreter(model_path=str(path), experimental_op_resolver_type=kind, num_threads=2)
    it.allocate_tensors()
    for d, x in zip(it.get_input_details(), inputs):
        it.set_tensor(d["index"], np.ascontiguousarray(x))
    it.invoke()
    return [it.get_tensor(d["index"]).copy() for d in it.get_output_details()]


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())


def scale(want: np.ndarray) -> float:
    """The error scale of convert's verify: max(1, max|torch output|)."""
    return max(1.0, float(np.abs(np.asarray(want, np.float64)).max()))


# ----------------------------------------------------------------------------- fp16 error bounds

NATIVE_FP16 = "avx512fp16" in cpu_flags()
# fp16 ops that only move or select values: exact, no rounding
_EXACT_FP16 = {"RESHAPE", "TRANSPOSE", "STRIDED_SLICE", "SLICE", "GATHER", "GATHER_ND", "CONCATENATION", "SELECT_V2",
               "SELECT", "NEG", "ABS", "SQUEEZE", "EXPAND_DIMS", "BROADCAST_TO", "TILE", "PAD", "PADV2", "MIRROR_PAD",
               "REVERSE_V2", "RESIZE_NEAREST_NEIGHBOR", "MAXIMUM", "MINIMUM", "SPLIT", "SPLIT_V", "PACK", "UNPACK",
               "MAX_POOL_2D", "DEPTH_TO_SPACE", "SPACE_TO_DEPTH", "RELU", "FLOOR", "ROUND"}
# with native fp16 arithmetic a transcendental is a polynomial evaluated in fp16: XNNPACK's
# f16 kernels (e.g. vsigmoid rr2_p2_nr1: two range-reduction steps, a degree-2 polynomial,
# one Newton step for the reciprocal) round about 8 times
_TRANSCENDENTAL = {"LOGISTIC", "TANH", "GELU", "EXP", "LOG", "SIN", "COS", "RSQRT", "SQRT", "POW", "HARD_SWISH"}
NATIVE_TRANSCENDENTAL_ROUNDINGS = 8
# with native fp16 arithmetic a reduction accumulates in fp16: one rounding per term
_REDUCTIONS = {"FULLY_CONNECTED", "BATCH_MATMUL", "CONV_2D", "DEPTHWISE_CONV_2D", "MEAN", "SUM", "SOFTMAX",
               "AVERAGE_POOL_2D"}


def fp16_rounding_depth(model, subgraph: int = 0, native: bool = NATIVE_FP16) -> int:
    """The most fp16 roundings on one path from the subgraph's inputs to an output: each op
    with an fp16 result rounds once (a composite: its decomposition's depth); ops that move
    values are exact. ``native``: XNNPACK's fp16 arithmetic, whose transcendentals round
    NATIVE_TRANSCENDENTAL_ROUNDINGS times and whose reductions once per accumulated term."""
    sg = model.subgraphs[subgraph]
    depth: dict[int, int] = {}
    for op in sg.operators:
        name = opname(model, op)
        d = max((depth.get(i, 0) for i in op.inputs if i >= 0), default=0)
        if name == "STABLEHLO_COMPOSITE":
            d += fp16_rounding_depth(model, op.builtinOptions2.decompositionSubgraphIndex, native)
        elif any(sg.tensors[o].type == TYPE_NAMES["FLOAT16"] for o in op.outputs) and name not in _EXACT_FP16:
            if name == "CAST" and sg.tensors[op.inputs[0]].type == TYPE_NAMES["FLOAT16"]:
                pass  # fp16 -> fp16 / int: no fp16 rounding
            elif native and name in _TRANSCENDENTAL:
                d += NATIVE_TRANSCENDENTAL_ROUNDINGS
            elif native and name in _REDUCTIONS and sg.tensors[op.inputs[0]].type == TYPE_NAMES["FLOAT16"]:
                d += int(sg.tensors[op.inputs[0]].shape[-1])
            else:
                d += 1
        for o in op.outputs:
            depth[o] = d
    return max((depth.get(o, 0) for o in sg.outputs), default=0)


def fp16_bound(path: str | Path, resolver: str, want: np.ndarray) -> float:
    """How far an fp16 file's output may be from torch fp16's: both round each op's result to
    nearest (at most half an fp16 step, 2^-11 relative, each), so per rounding on the path
    they may differ by one step (2^-10) of the value, which the tiny models' norms keep at or
    below the output's scale (passed on at unit gain): depth x 2^-10 x max(1, max|output|).
    XNNPACK with AVX512-FP16 rounds more often (fp16_rounding_depth's ``native``)."""
    depth = fp16_rounding_depth(read(path), native=NATIVE_FP16 and resolver == "xnnpack")
    return depth * 2.0 ** -10 * scale(want)


# ----------------------------------------------------------------------------- file structure

def schema():
    from ai_edge_litert import schema_py_generated

    return schema_py_generated


def read(path: str | Path):
    """The file as LiteRT's object API (ModelT)."""
    return schema().ModelT.InitFromPackedBuf(Path(path).read_bytes(), 0)


_OP_NAMES: dict[int, str] = {}


def opname(model, op) -> str:
    if not _OP_NAMES:
        ops = schema().BuiltinOperator
        _OP_NAMES.update({v: k for k, v in vars(ops).items() if not k.startswith("_") and isinstance(v, int)})
    code = model.operatorCodes[op.opcodeIndex]
    return _OP_NAMES[max(code.builtinCode, code.deprecatedBuiltinCode)]


TYPE_NAMES = {"FLOAT32": 0, "FLOAT16": 1, "INT32": 2, "INT64": 4, "BOOL": 6}
_TYPES = {v: k for k, v in TYPE_NAMES.items()}


def dtype(sg, index: int) -> str:
    return _TYPES.get(sg.tensors[index].type, str(sg.tensors[index].type))


def constant(model, sg, index: int) -> np.ndarray | None:
    """A constant tensor's values (inline buffers), else None."""
    t = sg.tensors[index]
    buf = model.buffers[t.buffer]
    if buf.data is None or len(buf.data) == 0:
        return None
    np_type = {0: np.float32, 1: np.float16, 2: np.int32, 4: np.int64}[t.type]
    return np.frombuffer(bytes(buf.data), np_type).reshape(t.shape)


@dataclass
class Composite:
    name: str
    attributes: dict[str, Any]
    subgraph: int  # decomposition subgraph index
    op: Any
    version: int  # OperatorCode.version


def composites(model, subgraph: int = 0) -> list[Composite]:
    from flatbuffers import flexbuffers

    out = []
    sg = model.subgraphs[subgraph]
    for op in sg.operators:
        if opname(model, op) != "STABLEHLO_COMPOSITE":
            continue
        o = op.builtinOptions2
        attrs = flexbuffers.Loads(bytes(o.compositeAttributes)) if o.compositeAttributes is not None else {}
        out.append(Composite(o.name.decode(), attrs, o.decompositionSubgraphIndex, op,
                             model.operatorCodes[op.opcodeIndex].version))
    return out


def composite_counts(model) -> Counter:
    return Counter(c.name for c in composites(model))


# ----------------------------------------------------------------------------- conversions

@dataclass
class Converted:
    """One conversion: the file, convert's Report, the inputs and torch's outputs."""

    path: Path
    report: Any
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    model: torch.nn.Module


def convert(build: Callable[[], torch.nn.Module], example: Callable[[], torch.Tensor], path: Path,
            dtype: torch.dtype = torch.float32, **kw: Any) -> Converted:
    """Build the model in ``dtype``, run torch on the example, convert for target tflite."""
    import circleops
    from circleops.pipeline.convert import export_module

    model = build().to(dtype).eval()
    x = example()
    if x.is_floating_point():
        x = x.to(dtype)
    with torch.no_grad():
        out = export_module(model)(x)
    name = {torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    report = circleops.convert(model, (x,), path, target="tflite", dtype=name, **kw)
    return Converted(path, report, [x.numpy()], [out.detach().numpy()], model)


# ----------------------------------------------------------------------------- one-op models

def one_op(opcode: str, operands: list[tuple[np.ndarray, bool]], out: np.ndarray,
           options_type: str | None = None, options: dict | None = None):
    """An ir.Model with the single operator ``opcode``: operands are (array, is_constant);
    the output is declared like ``out``. Returns (model, arrays to feed)."""
    from circleops import ir

    sg = ir.Subgraph("main")
    ins, feeds = [], []
    for k, (arr, is_const) in enumerate(operands):
        t = ir.Tensor(f"in{k}", tuple(arr.shape), ir.TORCH_TO_TYPE[torch.from_numpy(arr).dtype],
                      arr if is_const else None)
        idx = sg.add_tensor(t)
        ins.append(idx)
        if not is_const:
            sg.inputs.append(idx)
            feeds.append(arr)
    o = sg.add_tensor(ir.Tensor("out", tuple(out.shape), ir.TORCH_TO_TYPE[torch.from_numpy(out).dtype]))
    sg.outputs = [o]
    sg.operators.append(ir.Operator(opcode, ins, [o], options_type, dict(options or {})))
    return ir.Model([sg]), feeds
