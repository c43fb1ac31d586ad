"""Target profiles: what each target's file may hold and how its runtime behaves.

One frozen :class:`TargetProfile` per target. Lowerings never compare target names; they
ask the profile (``ctx.profile.fc_keep_num_dims``, ``ctx.supports("GATHER", dtype)``), so
adding a runtime, or a new onert version that runs more, is one new profile here:

    register_target(dataclasses.replace(ONERT, name="onert-0.2",
                                        missing_builtins=ONERT.missing_builtins - {"CUMSUM"}))

The onert facts are measured on onert 0.1.0 (shared/FACTS.md; tests/onert pins them).
This module imports nothing heavy (no torch), so the CLI can read TARGETS cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from circleops.errors import TargetError

FLATBUFFER_LIMIT = 2**31 - 1  # flatbuffers' 2 GiB maximum: a file past it needs weights after the flatbuffer

# How a fused circle op (schema/ops.yaml) is written:
BUILTIN = "builtin"        # the Circle builtin (RMS_NORM, ROPE, ATTENTION, INSTANCE_NORM)
DECOMPOSED = "decomposed"  # the op's reference kernel, lowered op by op
COMPOSITE = "composite"    # STABLEHLO_COMPOSITE whose decomposition subgraph is the reference kernel
CUSTOM = "custom"          # a CUSTOM op (custom_code + flexbuffer custom_options): users' and NPU vendors' ops
FUSED_FORMS = (BUILTIN, DECOMPOSED, COMPOSITE, CUSTOM)


@dataclass(frozen=True)
class Conv1x1Rule:
    """When a linear with a constant weight is written as a 1x1 CONV_2D instead of
    FULLY_CONNECTED: from ``min_rows`` rows of input, or for fewer rows when the output is
    at least ``min_widening`` times wider than the input (an lm_head in a decode step)."""

    min_rows: int
    min_widening: int

    def applies(self, rows: int, inner: int, out: int) -> bool:
        return rows >= self.min_rows or out >= self.min_widening * inner


@dataclass(frozen=True)
class TargetProfile:
    """Everything the lowering and the writer need to know about one target.

    Every field is required (no defaults): a new profile states each fact, and
    tests/lowering/test_lowering_profiles.py checks that each one is well-formed.
    Dtypes are torch dtype names without the ``torch.`` prefix ("float32", "int64").
    """

    name: str
    format: str  # the file format written: "circle" or "tflite"
    runtime: str  # the runtime that verifies its files by default: "onert", "litert", "reference"
    float_dtypes: frozenset[str]  # float dtypes a program (and every tensor) may compute in
    weights_after_flatbuffer: bool  # past 2 GiB, may weights follow the flatbuffer (Buffer.offset)?
    fused_ops: str  # BUILTIN or COMPOSITE: how a fused op is written when the target runs its builtin
    missing_builtins: frozenset[str]  # builtins the runtime lacks: lowerings pick another formulation
    builtin_dtypes: Mapping[str, frozenset[str]]  # builtins that run on these data dtypes only
    builtin_ranks: Mapping[str, frozenset[int]]  # builtins whose first input must have one of these ranks
    rope_max_positions: int | None  # ROPE is exact for at most this many positions (None: any)
    rope_modes: frozenset[str]  # circle::rope modes the ROPE builtin runs
    linear_as_conv: Conv1x1Rule | None  # write constant-weight linears as 1x1 CONV_2D when this says so
    fc_keep_num_dims: bool  # FULLY_CONNECTED honours keepNumDims (else rank > 2 inputs are flattened)
    reduce_drops_dims: bool  # reducers (SUM, MEAN, REDUCE_*) take keepDims=False (else keep and RESHAPE)
    copy_consumed_outputs: bool  # a subgraph output another op also reads needs its own copy
    legalize_fp16: bool  # fp16 ops without a CPU kernel compute in fp32 (tflite_fp16)
    rank0_inputs: bool  # the runtime takes 0-d graph inputs (else a 0-d input is written as [1])
    integer_graphs: bool  # PT2E integer graphs (quantized tensors between ops) may be written
    quantized_dtypes: frozenset[str]  # TensorType names of the quantized activations it loads
    quantized_per_channel_int8: bool  # int8 per-channel quantized weights compute right
    quantized_float_only: frozenset[str]  # builtins with no integer kernel: they stay float (DEQUANTIZE/QUANTIZE around)
    quantized_mean_needs_keep_dims: bool  # an integer MEAN without keepDims fails: it stays float
    quantized_uint8_as_int8: bool  # uint8 asymmetric activations are stored as INT8 (zero point - 128, same values)
    quantized_fixed_outputs: bool  # LOGISTIC / SOFTMAX / TANH outputs must carry the kernels' fixed parameters
    quantized_same_params: frozenset[str]  # integer builtins whose inputs must carry their output's parameters
    quantized_neg_raw: bool  # integer NEG negates stored values (no parameters, wraps): SUB(0, x) instead
    quantized_mean_square_narrow: int  # int16 RMSNorm op by op: its mean square also this many times finer (1: no)
    quantized_rsqrt_ranges: int  # int16 RSQRT: this many over narrower input ranges, their MINIMUM (1: as is)
    quantized_int16_bias: str  # TensorType of the bias of a FULLY_CONNECTED / CONV_2D on int16 activations
    quantized_verify_floor: float  # verify tolerance of an integer file at least this (relative): kernels' own deviation
    quantized_float_islands: bool  # an op with no integer kernel may stay float inside an integer graph
    integer_fused_ops: bool  # integer graphs keep the fused ops (else PT2E quantizes the unfused model)
    fuse_linear_dtypes: frozenset[str]  # weight TensorTypes whose sibling linears become one FC + split
    fuse_split_v: bool  # unequal parts of a fused linear split by one SPLIT_V (else one STRIDED_SLICE each)
    one_file_per_graph: bool  # generation graphs (convert --graphs) each in a file of their own, not signatures
    quantized_threads: int | None  # the NUM_THREADS quantized-weight files are made for by default (None: any)
    graph_inline_ops: frozenset[str]  # circle ops generation graphs (--graphs) write inline, decomposed, not fused
    matmul_packs_rhs: bool  # BATCH_MATMUL packs a non-constant right operand every run: one-column products as MUL + SUM
    attention_joint_rope: bool  # an inline attention rotates q and k as one tensor (circleops.lowering.attention_rope)

    def runs(self, opcode: str, dtype: str | None = None, rank: int | None = None) -> bool:
        """Whether the runtime executes builtin ``opcode`` (on ``dtype`` data of ``rank``)."""
        if opcode in self.missing_builtins:
            return False
        if dtype is not None and opcode in self.builtin_dtypes and _name(dtype) not in self.builtin_dtypes[opcode]:
            return False
        if rank is not None and opcode in self.builtin_ranks and rank not in self.builtin_ranks[opcode]:
            return False
        return True

    def fused_form(self, builtin: str) -> str:
        """How a fused op whose Circle builtin is ``builtin`` is written: one of FUSED_FORMS.

        A BUILTIN form can still fall back to the decomposition per node, when the builtin
        cannot express that node exactly (rope_max_positions, rope_modes, a scale ...)."""
        if self.fused_ops == COMPOSITE:
            return COMPOSITE
        return BUILTIN if self.runs(builtin) else DECOMPOSED

    def allows_float(self, dtype: object) -> bool:
        """Whether a tensor of float dtype ``dtype`` (torch dtype, name, or TensorType name) may appear."""
        return _name(dtype) in self.float_dtypes


def _name(dtype: object) -> str:
    """"float32" for torch.float32, "float32", or the TensorType name "FLOAT32"."""
    return str(dtype).removeprefix("torch.").lower()


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(dict(mapping))


_ALL_ROPE_MODES = frozenset({"gpt_neox", "gpt_j"})

# The builtin facts of a runtime in which no quirk was found (the reference interpreter, LiteRT):
# every builtin runs on every dtype and rank, ROPE on any positions and in both modes, linears
# stay FULLY_CONNECTED with keepNumDims, reducers drop dims, subgraph outputs need no copy.
# A profile with any quirk states each of these fields itself (ONERT).

# The integer facts of a runtime whose integer kernels compute as the format defines them
# (the reference interpreter, onert): any output parameters, any parameters on each input,
# NEG and RSQRT computed (no raw negation, no table), RMS_NORM one op, int32 biases, and no
# deviation of their own beyond the format's rounding steps.
_FORMAT_INTEGER_KERNELS: dict[str, Any] = dict(
    quantized_fixed_outputs=False,
    quantized_same_params=frozenset(),
    quantized_neg_raw=False,
    quantized_rsqrt_ranges=1,
    quantized_mean_square_narrow=1,
    quantized_int16_bias="INT32",
    quantized_verify_floor=0.0,
)
_NO_BUILTIN_QUIRKS: dict[str, Any] = dict(
    missing_builtins=frozenset(),
    builtin_dtypes=_frozen({}),
    builtin_ranks=_frozen({}),
    rope_max_positions=None,
    rope_modes=_ALL_ROPE_MODES,
    linear_as_conv=None,
    fc_keep_num_dims=True,
    reduce_drops_dims=True,
    copy_consumed_outputs=False,
)

CIRCLE = TargetProfile(
    name="circle",
    format="circle",
    runtime="reference",
    float_dtypes=frozenset({"float32", "float16", "bfloat16"}),
    weights_after_flatbuffer=True,
    fused_ops=BUILTIN,
    **_NO_BUILTIN_QUIRKS,
    legalize_fp16=False,
    rank0_inputs=True,
    integer_graphs=True,
    quantized_dtypes=frozenset({"UINT8", "INT8", "INT16", "INT4"}),
    quantized_per_channel_int8=True,
    quantized_float_only=frozenset(),
    quantized_mean_needs_keep_dims=False,
    quantized_uint8_as_int8=False,
    **_FORMAT_INTEGER_KERNELS,  # the reference interpreter requantizes any output parameters
    quantized_float_islands=True,
    integer_fused_ops=True,  # RMS_NORM, ROPE, ATTENTION take and give integer tensors
    fuse_linear_dtypes=frozenset(),  # NPU compilers see the model's own linears
    fuse_split_v=False,
    one_file_per_graph=False,  # one file, a signature per graph: the reference interpreter runs any
    quantized_threads=None,
    graph_inline_ops=frozenset(),  # ATTENTION builtin: NPU compilers take it whole
    matmul_packs_rhs=False,
    attention_joint_rope=False,
)

ONERT = TargetProfile(
    name="onert",
    format="circle",
    runtime="onert",
    float_dtypes=frozenset({"float32"}),  # fp16/bf16 tensors refused for every op tried
    weights_after_flatbuffer=False,  # onert 0.1.0 crashes (SIGSEGV) on Buffer.offset/size
    fused_ops=BUILTIN,
    missing_builtins=frozenset({
        "MIRROR_PAD",               # load fails
        "RESIZE_NEAREST_NEIGHBOR",  # "KernelGenerator: NYI"
        "INSTANCE_NORM",            # "KernelGenerator: NYI"
        "ATTENTION",                # "Unsupported operation"
        "CUMSUM",                   # no CPU kernel
        "REDUCE_MIN",               # load fails: "Unsupported operation"
        "SIGN", "CEIL", "HARD_SWISH", "ATAN2",  # load fails: "Unsupported operation" (tests/coverage)
        "TRANSPOSE_CONV",           # "KernelGenerator: NYI for operation 'TransposeConv'"
        "TOPK_V2",                  # load fails: "Unsupported operation"
        "SPLIT_V",                  # runs, silently wrong (outputs zeros or another part's values)
        "CUSTOM",                   # SIGSEGV at load (a custom_code without a C++ kernel built into onert)
        "PRELU",                    # "KernelGenerator: NYI for operation 'PReLU'" (tests/registry/test_tico_interop.py)
    }),
    builtin_dtypes=_frozen({
        # "Gather: unsupported input data type" for int64 / bool data (indices may be int64)
        "GATHER": frozenset({"float32", "int32"}),
        # no integer MAXIMUM, no int64 MINIMUM, no integer SELECT_V2 ("Max: unsupported data type")
        "MAXIMUM": frozenset({"float32"}),
        "MINIMUM": frozenset({"float32"}),
        "REVERSE_V2": frozenset({"float32"}),
        "TRANSPOSE": frozenset({"float32", "int32"}),  # int64, bool: "Transpose: unsupported data type"
        "SELECT_V2": frozenset({"float32"}),  # int32, int64, bool: "Select: unsupported data type"
    }),
    # RMS_NORM: rank 2 and 5 fail at prepare ("ShapeValidator")
    # PAD, PADV2: "Padding for rank > 4 NYI"
    # SUM, MEAN, REDUCE_MAX/PROD/ANY: rank 5 and 6 fail at prepare ("ShapeValidator"), with or
    # without keepDims: lowering.reduce merges dims down to rank 4 (Mamba2-style hybrids)
    builtin_ranks=_frozen({"RMS_NORM": frozenset({3, 4}), "PAD": frozenset({1, 2, 3, 4}),
                           "PADV2": frozenset({1, 2, 3, 4}),
                           "BATCH_MATMUL": frozenset({2, 3, 4}),  # rank 5: "ShapeValidator" at prepare
                           **{op: frozenset({0, 1, 2, 3, 4})
                              for op in ("SUM", "MEAN", "REDUCE_MAX", "REDUCE_PROD", "REDUCE_ANY")},
                           # silently wrong from rank 5, even on equal shapes (ADD, SUB, MUL, DIV are
                           # right): ctx.binary merges dims that broadcast alike
                           **{op: frozenset({0, 1, 2, 3, 4})
                              for op in ("EQUAL", "NOT_EQUAL", "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL",
                                         "MAXIMUM", "MINIMUM")},
                           "SELECT_V2": frozenset({0, 1, 2, 3, 4, 5}),  # rank 6, broadcast condition: wrong
                           # rank 6: "ShapeValidator" at prepare (Hiera's q/k/v unbind); ctx.slice merges dims
                           "STRIDED_SLICE": frozenset({0, 1, 2, 3, 4, 5})}),
    rope_max_positions=1,  # ROPE reads only the first row of sin/cos: exact for a decode step only
    rope_modes=frozenset({"gpt_neox"}),  # GPT_J: "Unsupported RoPE mode"
    # onert's CPU CONV_2D is a blocked GEMM, up to 2x faster than its FULLY_CONNECTED from 4
    # rows up (Llama lm_head 64x512x32000 62 -> 33 ms, 64x2048x5632 47 -> 23 ms) and, for
    # fewer rows (a decode step), when the output is 8x wider (an lm_head: 1x576x49152 10.0 ->
    # 5.1 ms); otherwise FULLY_CONNECTED is faster (1x2048x2048 0.65 vs 0.84 ms).
    # bench/onert_matmul.py measures it. Peak memory: +24 MB of working buffers on the 45M
    # Llama (onert session 238 -> 262 MB; tico's file 274).
    linear_as_conv=Conv1x1Rule(min_rows=4, min_widening=8),
    fc_keep_num_dims=False,  # fp32 FULLY_CONNECTED re-infers its output as [N, out]
    # reducing a rank-4 tensor over 2 axes without keepDims fails at prepare ("ShapeValidator")
    reduce_drops_dims=False,
    copy_consumed_outputs=True,  # an output a TRANSPOSE/RESHAPE also reads gets corrupted
    legalize_fp16=False,
    rank0_inputs=False,  # session preparation fails: "unsupported rank: 0"
    integer_graphs=True,
    # measured on onert 0.1.0 (bench/onert_quantized.py): no INT16 graph loads ("OperationValidator
    # failed"); int8 per-channel weights compute ~250 steps off; these have no integer kernel;
    # MEAN without keepDims: "ShapeValidator failed" at prepare
    quantized_dtypes=frozenset({"UINT8", "INT8"}),
    quantized_per_channel_int8=False,
    quantized_float_only=frozenset({"RELU", "RELU6", "STRIDED_SLICE", "BATCH_MATMUL", "RMS_NORM"}),
    quantized_mean_needs_keep_dims=True,
    quantized_uint8_as_int8=False,  # onert's uint8 kernels are the ones that compute right
    **_FORMAT_INTEGER_KERNELS,
    quantized_float_islands=True,  # quantized_float_only ops run float between DEQUANTIZE and QUANTIZE
    integer_fused_ops=True,
    # onert runs each GGML FULLY_CONNECTED as its own ggml graph, starting NUM_THREADS-1
    # workers per call (~66 us at 2 threads): q/k/v and gate/up as one call each
    # (circleops.passes.fuse_linears; bench/README.md). fp32 linears measured no faster fused.
    fuse_linear_dtypes=frozenset({"GGML_Q4_0", "GGML_Q8_0"}),
    fuse_split_v=False,  # onert 0.1.0's SPLIT_V is silently wrong (missing_builtins)
    # onert 0.1.0 runs subgraph 0 of a file and its Python API cannot select a signature; one
    # file with a dynamic sequence dimension does not work either (bench/onert_dynamic_seq.py:
    # every layout fails to prepare, returns the first run's shape, or crashes)
    one_file_per_graph=True,
    # GGML kernels: 1 thread measured faster on 2 shared cores; w8's hybrid FULLY_CONNECTED
    # (no CONV_2D form) is as fast at 1 as at 2 (bench/README.md)
    quantized_threads=1,
    graph_inline_ops=frozenset(),  # onert has no ATTENTION: decomposed there anyway
    matmul_packs_rhs=False,
    attention_joint_rope=False,
)

TFLITE = TargetProfile(
    name="tflite",
    format="tflite",
    runtime="litert",
    float_dtypes=frozenset({"float32", "float16"}),  # LiteRT's CPU kernels refuse bf16
    weights_after_flatbuffer=True,
    fused_ops=COMPOSITE,
    **_NO_BUILTIN_QUIRKS,
    legalize_fp16=True,
    rank0_inputs=True,
    # LiteRT's integer kernels (measured on ai-edge-litert 2.3.0 with one-op files, tests/tflite/
    # test_tflite_integer.py): int8 activations (FULLY_CONNECTED refuses uint8 with int8 weights:
    # "input->type == kTfLiteInt8 || input->type == kTfLiteInt16"), int16 with int8 weights (16x8)
    integer_graphs=True,
    quantized_dtypes=frozenset({"INT8", "INT16"}),
    quantized_per_channel_int8=True,
    quantized_float_only=frozenset(),
    quantized_mean_needs_keep_dims=False,
    quantized_uint8_as_int8=True,  # TFLite's convention: int8 asymmetric activations
    # "output->params.scale == 1. / 32768 was not true" (LOGISTIC), the same for SOFTMAX, TANH
    quantized_fixed_outputs=True,
    # int8 CONCATENATION: "t->params.scale != output->params.scale" at prepare (int16 requantizes)
    # CONCATENATION copies stored values: int8 refuses other parameters at prepare ("t->params.scale !=
    # output->params.scale"), int16 silently concatenates them unscaled (thousands of steps off)
    quantized_same_params=frozenset({"CONCATENATION"}),
    # NEG is -q: 255 steps off with an int8 zero point, and -(-32768) wraps to -32768 in int16
    quantized_neg_raw=True,
    # int16 RSQRT interpolates a 512-segment table over the whole input range: rsqrt(100) read ~1.0 with the
    # range at 8e5 (SmolLM2's norms); 3 ranges 16x apart, their MINIMUM (quantize/integer/passes/rsqrt_ranges.py)
    quantized_rsqrt_ranges=3,
    # one massive token sets the norms' mean-square range (SmolLM2: 8e5, a step of 25 for the others' 16-100):
    # computed also 256x finer, the fine one's rsqrt taken where it did not saturate (quantize/integer/passes/narrow_mean_squares.py)
    quantized_mean_square_narrow=256,
    # 16x8 CONV_2D reads its bias as int64 (an int32 one gives garbage, no error; FULLY_CONNECTED takes both)
    quantized_int16_bias="INT64",
    # int16 LOGISTIC / SOFTMAX / TANH / RSQRT are table lookups, 1-3 steps from exact per op on
    # random inputs, but RSQRT 24 steps on the sharp tiny Llama's norms (tests/families.py), whose
    # logits then end 7.2e-3 (relative) from the fake-quantized module; a plain tiny Llama 5.4e-4.
    # uint8's own tolerance (0.125) is far above this floor
    quantized_verify_floor=1e-2,
    quantized_float_islands=False,  # a full-integer file: an op without an integer kernel is an error
    # no integer composite: RMSNorm, RoPE and attention are quantized op by op (every
    # intermediate observed in calibration) and written as LiteRT's integer builtins
    integer_fused_ops=False,
    # the int4 / w8 hybrid linears (float input, INT4 blockwise or INT8 per-channel weight):
    # q/k/v and gate/up as one FULLY_CONNECTED each, so XNNPACK quantizes the shared input
    # to int8 once and runs 4 products a layer instead of 7 (bench/results/42-int4-decode.yaml)
    fuse_linear_dtypes=frozenset({"INT4", "INT8"}),
    fuse_split_v=False,  # STRIDED_SLICE, which XNNPACK delegates, keeps the partition whole
    one_file_per_graph=False,  # LiteRT runs any signature
    quantized_threads=None,
    # LiteRT's XNNPACK delegate takes the ops of a signature's own subgraph but never a
    # composite's decomposition subgraph (measured, tests/tflite/test_tflite_fp16.py): a
    # circle.attention composite kept each layer's q/k/v/o products, rope and softmax on the
    # builtin kernels, 1.5x litert-torch's prefill CPU time on SmolLM2 (bench/results/11-*).
    # Generation graphs are run on LiteRT's CPU, where no delegate knows circle.attention:
    # they write it inline. odml.rms_norm stays a composite (LiteRT's GPU delegate knows it;
    # litert-torch's own export keeps it too), and plain `convert` keeps every composite.
    graph_inline_ops=frozenset({"attention"}),
    # XNNPACK packs a BATCH_MATMUL's dynamic right operand on every run (x32_packw_gemm):
    # the decode step's products with its own new key (one column) and value (inner
    # dimension 1) cost two packs a layer; as MUL (+ SUM) they cost less
    # (circleops.lowering.linalg.batch_matmul; bench/results/60-*)
    matmul_packs_rhs=True,
    # q and k rotated as one tensor, rotate_half a product with a constant signed permutation,
    # a power-of-two 1/sqrt(D) folded into q: 8 fewer ops a layer besides free RESHAPEs, bit-equal outputs
    # (SmolLM2's int4 decode step: 1917 -> 1737 ops; bench/results/71-*)
    attention_joint_rope=True,
)

_PROFILES: dict[str, TargetProfile] = {p.name: p for p in (CIRCLE, ONERT, TFLITE)}
# every target, a read-only live view (register_target adds to it)
PROFILES: Mapping[str, TargetProfile] = MappingProxyType(_PROFILES)
# the built-in targets (the CLI's --target choices)
TARGETS: tuple[str, ...] = tuple(PROFILES)


def register_target(p: TargetProfile) -> TargetProfile:
    """Add a target: every conversion path (convert, save, --graphs, generate, the checks)
    then takes its name. A name already taken raises."""
    if p.name in _PROFILES:
        raise ValueError(f"target {p.name!r} is already registered")
    _PROFILES[p.name] = p
    return p


def unregister_target(name: str) -> None:
    """Remove a target added by register_target (tests that add their own)."""
    if name not in TARGETS:
        _PROFILES.pop(name, None)


def profile(target: str | TargetProfile) -> TargetProfile:
    """The profile of ``target`` (a name in TARGETS, or a TargetProfile, returned as is)."""
    if isinstance(target, TargetProfile):
        return target
    try:
        return PROFILES[target]
    except (KeyError, TypeError):
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(PROFILES)}") from None


__all__ = ["BUILTIN", "COMPOSITE", "CUSTOM", "DECOMPOSED", "FUSED_FORMS", "PROFILES", "TARGETS", "Conv1x1Rule",
           "TargetProfile", "profile", "register_target", "unregister_target"]
