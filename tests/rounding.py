"""Error bounds from the computation's depth: how many times a value is rounded on its way
to the output (docs/testing.md, "Tolerances from the format and the depth").

Two computations of the same graph (a runtime and torch, or two runtimes) may each round
every op's result differently (another summation order, another exp polynomial), so per
rounding on the deepest path they may end one step of the format apart, passed on at unit
gain. A sum of n terms is not one rounding but n - 1: in any order, its rounding error
stays below LAMBDA * sqrt(n) unit roundoffs of the terms' magnitude with probability at
least 1 - 2 exp(-LAMBDA^2 / 2) (Higham & Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 41(5), 2019): the worst case n grows too fast to bound
a real model by, and the probabilistic bound is what rounding errors do in practice.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

# Higham & Mary's lambda: the bound fails with probability below 2 exp(-18) ~ 3e-8 per sum
LAMBDA = 6.0
FP32_STEP = 2.0 ** -23  # two round-to-nearest fp32 results of one value: at most one ulp apart
FP16_STEP = 2.0 ** -10
# ops that move, select, compare or convert to integers: exact
EXACT = {"RESHAPE", "TRANSPOSE", "STRIDED_SLICE", "SLICE", "GATHER", "GATHER_ND", "CONCATENATION", "SELECT_V2",
         "SELECT", "NEG", "ABS", "SQUEEZE", "EXPAND_DIMS", "BROADCAST_TO", "TILE", "PAD", "PADV2", "MIRROR_PAD",
         "REVERSE_V2", "RESIZE_NEAREST_NEIGHBOR", "MAXIMUM", "MINIMUM", "SPLIT", "SPLIT_V", "PACK", "UNPACK",
         "MAX_POOL_2D", "DEPTH_TO_SPACE", "SPACE_TO_DEPTH", "RELU", "FLOOR", "ROUND", "LESS", "LOGICAL_NOT",
         "EQUAL", "GREATER", "GREATER_EQUAL", "LESS_EQUAL", "NOT_EQUAL", "LOGICAL_AND", "LOGICAL_OR", "ARG_MAX",
         "ARG_MIN", "SHAPE", "FILL", "RANGE", "ZEROS_LIKE", "ONES_LIKE", "GATHER", "SCATTER_ND", "TOPK_V2"}
# libm / SLEEF / XNNPACK evaluations of a transcendental are within a few ulp of each other
# (SLEEF's u10 functions 1 ulp, XNNPACK's fp32 polynomials ~2): 4 steps between two of them
TRANSCENDENTAL = {"LOGISTIC", "TANH", "EXP", "LOG", "SIN", "COS", "RSQRT", "SQRT", "POW", "GELU", "HARD_SWISH",
                  "ELU", "LOG_SOFTMAX"}
TRANSCENDENTAL_STEPS = 4
ELEMENTWISE = {"ADD", "SUB", "MUL", "DIV", "SQUARED_DIFFERENCE", "SQUARE", "LEAKY_RELU", "PRELU", "RELU6",
               "RELU_N1_TO_1", "DEQUANTIZE", "QUANTIZE", "CAST"}


def sum_steps(n: int) -> float:
    """Steps between two roundings of a sum of ``n`` terms in any orders (Higham & Mary)."""
    return LAMBDA * math.sqrt(max(int(n), 1))


def _numel(shape: Any) -> int:
    return int(math.prod(int(s) for s in shape)) if shape else 1


def _op_steps(model: Any, sg: Any, op: Any, reductions_round_once: bool, native_fp16: bool) -> float:
    """Steps of one op of ``model``'s subgraph ``sg``. ``reductions_round_once``: its sums are
    accumulated wider than the result and rounded once (torch's fp16 CPU kernels without
    native fp16 arithmetic) instead of per term."""
    shape = [tuple(sg.tensors[i].shape) if i >= 0 else () for i in op.inputs]

    def red(n: int) -> float:
        return 1.0 if reductions_round_once else sum_steps(n)

    name = op.opcode
    if name in EXACT:
        return 0.0
    if name in ELEMENTWISE:
        return 1.0
    if name in TRANSCENDENTAL:
        return TRANSCENDENTAL_STEPS * (2 if native_fp16 else 1)
    if name == "FULLY_CONNECTED":
        return red(shape[1][-1]) + 1  # + the bias
    if name == "BATCH_MATMUL":
        adj_x = bool(op.options.get("adjX") or op.options.get("adj_x"))
        return red(shape[0][-2] if adj_x else shape[0][-1])
    if name in ("CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV"):
        w = shape[1]
        return red(_numel(w[1:]) if name != "DEPTHWISE_CONV_2D" else w[1] * w[2]) + 1
    if name in ("MEAN", "SUM", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_PROD", "AVERAGE_POOL_2D"):
        out = sg.tensors[op.outputs[0]].shape
        return 0.0 if name in ("REDUCE_MAX", "REDUCE_MIN") else red(_numel(shape[0]) // max(_numel(out), 1)) + 1
    if name == "SOFTMAX":
        return TRANSCENDENTAL_STEPS + red(shape[0][-1]) + 1
    if name in ("RMS_NORM", "L2_NORMALIZATION"):
        return 1 + red(shape[0][-1]) + 1 + TRANSCENDENTAL_STEPS + 2
    if name in ("LAYER_NORM", "INSTANCE_NORM"):
        return 2 * red(shape[0][-1]) + 4 + TRANSCENDENTAL_STEPS
    if name == "ROPE":
        return 3.0
    if name == "ATTENTION":  # x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos
        cache = max(shape[8]) if len(shape) > 8 else 1
        head = shape[5][-1] if len(shape) > 5 and shape[5] else shape[1][0]
        return (red(shape[0][-1]) + 1 + 3 + red(head) + 2 + TRANSCENDENTAL_STEPS + red(cache) + 1 + red(cache)
                + red(shape[4][-1]) + 1)
    if name == "STABLEHLO_COMPOSITE":
        return rounding_steps(model, int(op.options["decompositionSubgraphIndex"]), reductions_round_once,
                              native_fp16)
    raise ValueError(f"tests/rounding.py: no rounding count for {name}; add it to one of the op sets")


def rounding_steps(model: Any, subgraph: int = 0, reductions_round_once: bool = False,
                   native_fp16: bool = False) -> float:
    """The most rounding steps on one path from the subgraph's inputs to an output."""
    return max(output_steps(model, subgraph, reductions_round_once, native_fp16), default=0.0)


def output_steps(model: Any, subgraph: int = 0, reductions_round_once: bool = False,
                 native_fp16: bool = False, dtypes: tuple[str, ...] = ("FLOAT32", "FLOAT16")) -> list[float]:
    """Per output of the subgraph (in order): the most rounding steps on one path to it.
    ``model`` is a circleops.ir.Model (serialize.read_model); only ops with a result in
    ``dtypes`` round."""
    sg = model.subgraphs[subgraph]
    steps: dict[int, float] = {}
    for op in sg.operators:
        d = max((steps.get(i, 0.0) for i in op.inputs if i >= 0), default=0.0)
        if any(sg.tensors[o].dtype in dtypes for o in op.outputs) or op.opcode == "STABLEHLO_COMPOSITE":
            d += _op_steps(model, sg, op, reductions_round_once, native_fp16)
        for o in op.outputs:
            steps[o] = d
    return [steps.get(o, 0.0) for o in sg.outputs]


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo): kernels (XNNPACK, oneDNN) pick code by them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return frozenset(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return frozenset()


def native_fp16() -> bool:
    """Whether this CPU computes fp16 natively (AVX512-FP16 or AMX-FP16: Intel Sapphire Rapids
    and later), where XNNPACK and oneDNN may accumulate fp16 sums in fp16."""
    return bool({"avx512fp16", "amx_fp16"} & cpu_flags())


def pt2e_rounding_depth(graph: torch.fx.Graph) -> int:
    """The most activation roundings (quantize nodes) on one path of a PT2E (fake-quantized)
    graph. Two implementations of the graph (torch's float fake-quant, a fixed-point kernel
    set) may round a value on a boundary differently at each of them: passed on at unit gain,
    their outputs differ by at most this many output steps (times each kernel's own
    per-op deviation)."""
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    depth: dict = {}
    for n in graph.nodes:
        d = max((depth[a] for a in n.all_input_nodes), default=0)
        depth[n] = d + (n.op == "call_function" and n.target == quantize)
    return max(depth.values(), default=0)


# A fixed-point kernel's result vs another implementation's (LiteRT vs the reference
# interpreter), in steps of the op's output: int8 kernels 0-1 step; LiteRT's int16 LOGISTIC,
# SOFTMAX, TANH, RSQRT, EXP are table lookups 1-3 steps off (measured on one-op files,
# tests/tflite/test_tflite_integer.py)
INTEGER_LUT_OPS = {"LOGISTIC", "SOFTMAX", "TANH", "RSQRT", "EXP", "LOG", "GELU", "HARD_SWISH", "SQRT", "POW"}
INTEGER_LUT_STEPS = 3


def integer_output_bounds(model: Any, subgraph: int = 0) -> list[float]:
    """Per output of an integer file's subgraph: how far two fixed-point implementations of it
    may end apart, in the output's units (docs/testing.md): at every op with a quantized
    integer result a value on a rounding boundary may land one of its kernel's deviations
    apart (1 step, INTEGER_LUT_STEPS for int16 table lookups), moving the output by at most
    that many of its own steps (passed on at unit gain, in output steps): the sum of the
    deviations on the deepest path, times the step of the integer tensor the output is
    dequantized from (or the output's own)."""
    sg = model.subgraphs[subgraph]
    steps: dict[int, float] = {}
    source: dict[int, int] = {}  # a DEQUANTIZE's output -> the integer tensor it reads
    for op in sg.operators:
        d = max((steps.get(i, 0.0) for i in op.inputs if i >= 0), default=0.0)
        out = sg.tensors[op.outputs[0]] if op.outputs else None
        if op.opcode == "DEQUANTIZE":
            source[op.outputs[0]] = op.inputs[0]
        elif out is not None and out.quant is not None and out.dtype in ("INT8", "INT16", "UINT8") \
                and op.opcode not in EXACT:
            d += INTEGER_LUT_STEPS if op.opcode in INTEGER_LUT_OPS and out.dtype == "INT16" else 1
        for o in op.outputs:
            steps[o] = d
    bounds = []
    for o in sg.outputs:
        q = sg.tensors[source.get(o, o)].quant
        step = float(max(q.scale)) if q is not None and q.scale is not None and len(q.scale) else 0.0
        bounds.append(steps.get(o, 0.0) * step)
    return bounds


_SUMS = {"FULLY_CONNECTED", "BATCH_MATMUL", "CONV_2D", "DEPTHWISE_CONV_2D", "MEAN", "SUM", "SOFTMAX", "RMS_NORM",
         "AVERAGE_POOL_2D"}


def fp16_roundings(model: Any, subgraph: int = 0, native_fp16: bool = False) -> list[float]:
    """Per output: the most fp16 roundings on one path from the inputs (each fp16 constant
    rounded once from the model's fp32 value): one per op with an fp16 result (ATTENTION: its
    seven steps); with native fp16 arithmetic a sum of n terms rounds n / 2 partial sums of its
    size and a transcendental ~8 times (XNNPACK's / oneDNN's fp16 kernels). Two runs whose
    roundings are independent, each within half an fp16 step: the error's RMS relative to the
    values is 2^-11 sqrt(roundings / 3) (uniform errors), its maximum within LAMBDA of that."""
    sg = model.subgraphs[subgraph]
    count: dict[int, float] = {i: 1.0 for i, t in enumerate(sg.tensors) if t.data is not None and t.dtype == "FLOAT16"}
    for op in sg.operators:
        r = max((count.get(i, 0.0) for i in op.inputs if i >= 0), default=0.0)
        if any(sg.tensors[o].dtype == "FLOAT16" for o in op.outputs) and op.opcode not in EXACT:
            n = int(sg.tensors[op.inputs[0]].shape[-1]) if sg.tensors[op.inputs[0]].shape else 1
            if op.opcode == "ATTENTION":  # projections, rope, scores, softmax, weighted sum, output
                r += 7 + (4 * n if native_fp16 else 0)
            elif native_fp16 and op.opcode in _SUMS:
                r += n / 2
            elif native_fp16 and op.opcode in TRANSCENDENTAL:
                r += 8
            else:
                r += 1
        for o in op.outputs:
            count[o] = r
    return [count.get(o, 0.0) for o in sg.outputs]


def fp16_error_bound(roundings: float) -> float:
    """The largest relative error ``roundings`` independent fp16 roundings leave (see fp16_roundings)."""
    return LAMBDA * 2.0 ** -11 * math.sqrt(roundings / 3)
