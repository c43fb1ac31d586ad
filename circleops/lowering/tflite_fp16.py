"""fp16 graphs for LiteRT: keep torch's fp16 dataflow, compute in fp32 where LiteRT must.

An fp16 program lowers to the torch graph as is: fp16 activations and weights, with the
fp32 islands torch has (RMSNorm upcasts, softmax in fp32). LiteRT's CPU runs only part of
that. Measured with ai-edge-litert 2.3.0, one-op fp16 models:

* the builtin kernels run fp16 for the ops in ``FP16_KERNELS`` (ADD, MUL, LOGISTIC, GELU,
  SOFTMAX, CAST, the data-movement ops, ...) and refuse it for the rest: FULLY_CONNECTED,
  BATCH_MATMUL, CONV_2D, MEAN, SUM, SUB, DIV, RSQRT, SQRT, EXP, POW, ... ("input->type !=
  kTfLiteFloat32").
* the default XNNPACK delegate takes most fp16 ops of the *main* subgraph, but never the
  decomposition subgraph of a STABLEHLO_COMPOSITE: those run on the builtin kernels, so an
  fp16 attention composite fails at prepare ("FULLY_CONNECTED failed to prepare").
* FULLY_CONNECTED with a non-constant fp16 weight fails even under XNNPACK.

So relying on true fp16 compute would make a file that runs only where XNNPACK happens to
claim every op. Instead every subgraph is legalized for the builtin kernels, which makes
the file run with or without delegates (tests/tflite runs both):

* an op whose kernel has fp16 keeps it (torch computes it in fp16 too);
* any other op computes in fp32: its fp16 weights stay fp16 in the file and are widened by
  DEQUANTIZE (LiteRT evaluates a constant DEQUANTIZE once, at prepare: TFLite's standard
  "float16 quantization"), its fp16 activations are CAST to fp32, and its result is CAST
  back to fp16 — the rounding point torch has, so the numerics follow the torch fp16 graph
  (torch's CPU kernels also accumulate fp16 matmuls in fp32 and round the result).

Subgraph inputs and outputs keep their dtypes, so a composite's interface stays what the
torch op had (fp16 x and weight for an fp16 RMSNorm) and its decomposition keeps torch's
fp32 island (CAST to fp32, the norm, CAST back), which an NPU delegate can take whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from circleops import ir

F16, F32 = "FLOAT16", "FLOAT32"

# Builtins whose LiteRT 2.3.0 CPU kernel runs fp16 tensors (BUILTIN_WITHOUT_DEFAULT_DELEGATES,
# checked against the fp32 kernel; tests/tflite/test_tflite_fp16.py pins the list).
FP16_KERNELS: frozenset[str] = frozenset({
    "ADD", "MUL", "MAXIMUM", "MINIMUM", "NEG", "LOGISTIC", "TANH", "GELU", "SIN", "COS",
    "FLOOR", "ROUND", "SOFTMAX",
    "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL", "SELECT_V2",
    "RESHAPE", "TRANSPOSE", "CONCATENATION", "STRIDED_SLICE", "GATHER", "BROADCAST_TO", "TILE",
    "PAD", "PADV2", "MIRROR_PAD", "REVERSE_V2", "RESIZE_NEAREST_NEIGHBOR",
    "CAST", "DEQUANTIZE",
    # runs its decomposition subgraph, which is legalized on its own
    "STABLEHLO_COMPOSITE",
})

# TFLite op versions for fp16 input (tensorflow/lite/tools/versioning/op_version.cc):
# DEQUANTIZE of float16 is version 3.
_DEQUANTIZE_FP16_VERSION = 3


@dataclass
class Fp16Report:
    """What ``legalize_fp16`` changed: ops moved to fp32, DEQUANTIZEd weights, CASTs added."""

    widened: dict[str, int] = field(default_factory=dict)
    dequantized: int = 0
    casts: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.widened)


def legalize_fp16(model: ir.Model, kernels: frozenset[str] = FP16_KERNELS) -> Fp16Report:
    """Rewrite ``model`` in place so that every fp16 op has a LiteRT CPU kernel (see the
    module docstring). fp32 models are left untouched."""
    report = Fp16Report()
    for sg in model.subgraphs:
        _legalize_subgraph(sg, kernels, report)
    return report


def _legalize_subgraph(sg: ir.Subgraph, kernels: frozenset[str], report: Fp16Report) -> None:
    widened: dict[int, int] = {}  # fp16 tensor -> its fp32 copy (one CAST/DEQUANTIZE each)
    ops: list[ir.Operator] = []

    def wide(i: int) -> int:
        if i not in widened:
            t = sg.tensors[i]
            j = sg.add_tensor(ir.Tensor(f"{t.name}_fp32", t.shape, F32))
            if t.is_const:
                ops.append(ir.Operator("DEQUANTIZE", [i], [j], version=_DEQUANTIZE_FP16_VERSION))
                report.dequantized += 1
            else:
                ops.append(_cast(i, j))
                report.casts += 1
            widened[i] = j
        return widened[i]

    for op in sg.operators:
        if op.opcode in kernels or not any(
                i >= 0 and sg.tensors[i].dtype == F16 for i in [*op.inputs, *op.outputs]):
            ops.append(op)
            continue
        report.widened[op.opcode] = report.widened.get(op.opcode, 0) + 1
        op.inputs = [wide(i) if i >= 0 and sg.tensors[i].dtype == F16 else i for i in op.inputs]
        narrow = []
        outputs = []
        for o in op.outputs:
            t = sg.tensors[o]
            if t.dtype != F16:
                outputs.append(o)
                continue
            j = sg.add_tensor(ir.Tensor(f"{t.name}_fp32", t.shape, F32))
            outputs.append(j)
            narrow.append(_cast(j, o))
        op.outputs = outputs
        ops.append(op)
        ops.extend(narrow)
        report.casts += len(narrow)
    sg.operators = ops


def _cast(src: int, dst: int) -> ir.Operator:
    # no options: the writer takes CastOptions' in/out types from the tensors
    return ir.Operator("CAST", [src], [dst])
