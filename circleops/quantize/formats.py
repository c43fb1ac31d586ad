"""The quantization formats: one :class:`WeightFormat` per ``--quantize`` choice, asked by
every other module (the CLI's choices, option checks, the weight pass, the runtime choice,
the GGUF loader, the report).

Adding a weight-only format is its codec module (``encode``/``decode``/``decode_into`` over a
schema TensorType, see :class:`Codec`) and one :func:`register` call here (plus an
interpreter kernel when its TensorType is new); tests/quantize/test_formats_registry.py
registers one that exists only in the test and converts, verifies and runs a model with it.

This module imports only the standard library: the CLI reads the choices without torch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol

# WeightFormat.kind
WEIGHTS = "weights"  # weight-only: float activations, an IR pass after lowering (quantize.weights)
INTEGER = "integer"  # a PT2E integer graph: quantized tensors between ops (quantize.integer)

# WeightFormat.form (weight-only formats)
BLOCKS = "blocks"  # the linear's weight is one tensor of tensor_type (GGML blocks)
HYBRID = "hybrid"  # INT8 weight with scale [1.0], then a MUL by the per-channel scales (onert's hybrid FC)
# INT8 weight carrying its per-output-channel scales (quantized_dimension 0, zero points 0):
# TFLite's dynamic-range FULLY_CONNECTED, float input and output, which LiteRT's XNNPACK runs
PER_CHANNEL = "per_channel"
# INT4 weight with its block scales in the weight's quantization (the TFLite schema's
# BlockwiseQuantization, FLOAT16 scales) or per channel; the embedding an EMBEDDING_LOOKUP of a
# quantized table: LiteRT's XNNPACK qd8-f32-qb4w / qc4w FULLY_CONNECTED (circleops.quantize.int4)
BLOCKWISE = "blockwise"
FORMS = (BLOCKS, HYBRID, PER_CHANNEL, BLOCKWISE)

# CPU flags onert 0.1.0's GGML kernels need (the instructions found in its libbackend_cpu.so;
# circleops.runtime.host says more)
ONERT_GGML_CPU_FLAGS: tuple[str, ...] = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


class Codec(Protocol):
    """What a weight format's codec module provides (circleops.quantize.ggml, .int8)."""

    BLOCK: int  # the input length K of a linear must be a multiple of it (1: any)

    def encode(self, weight: Any, dtype: str, importance: Any = None) -> Any: ...

    def decode(self, packed: Any, dtype: str, shape: tuple[int, ...]) -> Any: ...

    def decode_into(self, packed: Any, dtype: str, out: Any) -> Any: ...


@dataclass(frozen=True)
class WeightFormat:
    """One ``--quantize`` choice: what it stores, where, and what runs it."""

    name: str  # the one name, in the CLI, the API, the manifest and the docs
    summary: str  # what it stores (--help, errors)
    kind: str  # WEIGHTS or INTEGER
    tensor_type: str | None = None  # the schema TensorType of its linear weights (WEIGHTS)
    codec: str | None = None  # the module packing and unpacking tensor_type (and head_type)
    form: str = BLOCKS  # how a linear is written (WEIGHTS): BLOCKS or HYBRID
    # file format -> how a linear is written there, where it differs from ``form`` (w8: the
    # TFLite schema's per-channel INT8 weight, which LiteRT computes right and onert does not)
    file_forms: Mapping[str, str] = field(default_factory=dict)
    head_type: str | None = None  # the output head (lm_head) at a higher type, or None
    table_type: str | None = None  # the embedding table's type where it differs from tensor_type (BLOCKWISE)
    block_size: int | None = None  # the codec's block (BLOCKWISE: columns per scale, 0 per channel; None: codec's)
    embedding: bool = False  # the embedding table is stored at tensor_type too
    tied_table: bool = True  # a tied head may share the embedding table's blocks (else its own higher type)
    # BLOCKWISE: the head two-stage with this many candidates (0: one head_type product): every
    # logit from a 4-bit copy of the head, the k best rescored with the head_type rows the
    # embedding lookup reads (circleops.quantize.topk_head)
    head_topk: int = 0
    importance: bool = False  # block scales fitted to the linears' inputs (quantize.importance)
    smoothing: bool = False  # SmoothQuant folded into the weights first (quantize.smooth)
    rotation: bool = False  # an LLM's Hadamard rotation folded into the weights first (quantize.rotate)
    gptq: bool = False  # GPTQ rounding of the linears on the calibration text (quantize.int4_gptq)
    gguf_type: str | None = None  # the GGUF tensor type carried over as it is (a GGUF model's blocks)
    # circle ops its generation graphs (--graphs) write inline as well as the target's own
    # (TargetProfile.graph_inline_ops): int4 decodes faster with no composite splitting XNNPACK's graph
    graph_inline_ops: frozenset[str] = frozenset()
    activations: str | None = None  # INTEGER: the activation scheme ("uint8", "int16")
    file_formats: frozenset[str] = frozenset()  # file formats whose schema holds its weights (WEIGHTS)
    target_refusal: str = ""  # why a target writing another file format cannot (the end of the error message)
    runtimes: frozenset[str] = frozenset()  # runtimes that run its files
    host_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # runtime -> CPU flags it needs
    # the format's rounding step at the output's scale, relative (verify's tolerance is a few of
    # them, circleops.pipeline.stages.format_tolerance): an integer graph's output quantum against the
    # fake-quantized module (uint8: ~2 max|output| / 255; int16: 2^-15), or the GGML / w8
    # kernels' int8 rounding of each linear's input (absmax / 127 per block or row), which torch
    # on the dequantized weights does not do
    step: float = 2.0 ** -7

    @property
    def block(self) -> int:
        """K must be a multiple of this for a linear to be stored in the format."""
        return self.codec_module().BLOCK if self.codec else 1

    def codec_module(self) -> Codec:
        """The codec (imported now: it may import torch)."""
        if self.codec is None:
            raise ValueError(f"format {self.name} has no weight codec")
        return importlib.import_module(self.codec)  # type: ignore[return-value]

    def form_for(self, file_format: str | None) -> str:
        """How a linear is written in a ``file_format`` ("circle", "tflite") file (None: ``form``)."""
        return self.file_forms.get(file_format, self.form) if file_format is not None else self.form

    def tensor_types(self) -> tuple[str, ...]:
        """The TensorTypes its weights may be stored as (the head's and the table's too)."""
        return tuple(dict.fromkeys(t for t in (self.tensor_type, self.head_type, self.table_type) if t))

    def codec_options(self) -> dict[str, Any]:
        """Keyword arguments of the codec's ``encode`` besides the weight (the block size)."""
        return {"block": self.block_size} if self.block_size is not None else {}


_FORMATS: dict[str, WeightFormat] = {}
FORMATS: Mapping[str, WeightFormat] = MappingProxyType(_FORMATS)


def register(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` (a name already taken raises: one name, one format)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"quantization format {fmt.name!r} is already registered")
    if fmt.kind not in (WEIGHTS, INTEGER) or (fmt.kind == WEIGHTS and not (fmt.tensor_type and fmt.codec)):
        raise ValueError(f"format {fmt.name!r}: a {WEIGHTS} format names its tensor_type and codec")
    if any(f not in FORMS for f in (fmt.form, *fmt.file_forms.values())):
        raise ValueError(f"format {fmt.name!r}: forms are {', '.join(FORMS)}")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests that register their own)."""
    _FORMATS.pop(name, None)


def get(name: str | None) -> WeightFormat | None:
    """The format called ``name`` (None for None or an unknown name)."""
    return _FORMATS.get(name) if name is not None else None


def names(kind: str | None = None) -> tuple[str, ...]:
    """The format names, of ``kind`` when given, in registration order."""
    return tuple(n for n, f in _FORMATS.items() if kind is None or f.kind == kind)


def host_flags(name: str | None, runtime: str) -> tuple[str, ...]:
    """The CPU flags ``runtime`` needs to run a file quantized as ``name`` (() for none)."""
    f = get(name)
    return tuple(f.host_flags.get(runtime, ())) if f is not None else ()


def tensor_host_flags(tensor_types: Any, runtime: str) -> tuple[str, ...]:
    """The CPU flags ``runtime`` needs for a file holding weights of ``tensor_types``."""
    wanted = set(tensor_types)
    flags: dict[str, None] = {}
    for f in _FORMATS.values():
        if wanted & set(f.tensor_types()):
            flags.update(dict.fromkeys(f.host_flags.get(runtime, ())))
    return tuple(flags)


_CIRCLE_FILES = frozenset({"circle"})  # GGML and hybrid INT8 weights: Circle schema types
_GGML_REFUSAL = ("stores GGML block weights, which exist only in Circle (the TFLite schema has no GGML types): use "
                 "target 'onert' or 'circle', or leave out quantize for tflite")
_GGML_RUNTIMES = frozenset({"onert", "reference"})
_ONERT_AVX512 = {"onert": ONERT_GGML_CPU_FLAGS}

register(WeightFormat(
    "q4_0", "GGML_Q4_0 linear weights and embedding table, the output head (lm_head) GGML_Q8_0 (targets onert, "
    "circle)", WEIGHTS, "GGML_Q4_0", "circleops.quantize.ggml", head_type="GGML_Q8_0", embedding=True,
    tied_table=False, importance=True, gguf_type="Q4_0", file_formats=_CIRCLE_FILES, target_refusal=_GGML_REFUSAL,
    runtimes=_GGML_RUNTIMES, host_flags=_ONERT_AVX512))
register(WeightFormat(
    "q4_0-pure", "GGML_Q4_0 linear weights and embedding table, a tied lm_head sharing the table (4.5 "
    "bits/weight; targets onert, circle)", WEIGHTS, "GGML_Q4_0", "circleops.quantize.ggml", embedding=True,
    importance=True, gguf_type="Q4_0", file_formats=_CIRCLE_FILES, target_refusal=_GGML_REFUSAL, runtimes=_GGML_RUNTIMES,
    host_flags=_ONERT_AVX512))
register(WeightFormat(
    "q8_0", "GGML_Q8_0 linear weights (8.5 bits/weight; targets onert, circle)", WEIGHTS, "GGML_Q8_0",
    "circleops.quantize.ggml", gguf_type="Q8_0", file_formats=_CIRCLE_FILES, target_refusal=_GGML_REFUSAL,
    runtimes=_GGML_RUNTIMES, host_flags=_ONERT_AVX512))
register(WeightFormat(
    "w8", "int8 per-channel linear weights, fp32 activations (onert's hybrid FULLY_CONNECTED + MUL: runs on any "
    "x86-64 onert, no AVX-512 needed; targets onert, circle; target tflite: LiteRT's dynamic-range "
    "FULLY_CONNECTED, the per-channel scales in the weight)", WEIGHTS, "INT8", "circleops.quantize.int8",
    form=HYBRID, file_forms={"tflite": PER_CHANNEL}, smoothing=True, file_formats=frozenset({"circle", "tflite"}),
    target_refusal="writes int8 weights for onert's hybrid FULLY_CONNECTED or LiteRT's dynamic-range one: use "
                   "target 'onert', 'circle' or 'tflite'",
    runtimes=frozenset({*_GGML_RUNTIMES, "litert"})))
register(WeightFormat(
    "uint8", "integer graph: uint8 asymmetric activations, int8 per-channel weights, int32 bias (PT2E; targets "
    "circle, onert, tflite: stored there as TFLite's int8 asymmetric activations, the same values)", INTEGER,
    activations="uint8", runtimes=frozenset({"onert", "litert", "reference"})))
register(WeightFormat(
    "int16", "integer graph: int16 symmetric activations, int8 per-channel weights, int32 bias (PT2E; targets "
    "circle, tflite: LiteRT's 16x8 kernels)", INTEGER, activations="int16", runtimes=frozenset({"litert", "reference"}),
    step=2.0 ** -15))

_INT4_REFUSAL = ("writes INT4 block weights for LiteRT's XNNPACK FULLY_CONNECTED (TFLite BlockwiseQuantization): "
                 "use target 'tflite' (for onert or circle: q4_0)")
_INT4_STEP = 2.0 ** -7  # XNNPACK rounds each linear's input to int8 per row (as w8): torch on the
# dequantized weights does not; the weights' own rounding is in the reference's weights
# the two-stage head's candidates per format (WeightFormat.head_topk; circleops.quantize.topk_head):
# not int4's default, since its measured gain is thin (SmolLM2, results 76: decode CPU 0.95x at 1
# thread, 1.00x at 2) for +0.6 points of perplexity and a file 15 % larger
_HEAD_TOPK = {"int4-topk": 64}
for _name, _block, _what in (("int4", 32, "blocks of 32 (an fp16 scale each: 4.5 bits/weight)"),
                             ("int4-b64", 64, "blocks of 64 (4.25 bits/weight)"),
                             ("int4-b128", 128, "blocks of 128 (4.125 bits/weight; a width without one: "
                                                "the largest multiple of 32 dividing it)"),
                             ("int4-pc", 0, "one scale per output channel (fastest, least accurate)"),
                             ("int4-topk", 32, "blocks of 32, the tied head two-stage (every logit from a 4-bit "
                                               "copy of it, the 64 largest rescored with its INT8 rows)")):
    register(WeightFormat(
        _name, f"int4 linear weights in {_what}, dynamically quantized int8 activations (LiteRT's XNNPACK "
        "qd8 FULLY_CONNECTED); embedding and lm_head int8 per row, sharing one table; target tflite", WEIGHTS,
        "INT4", "circleops.quantize.int4", form=BLOCKWISE, head_type="INT8", table_type="INT8", embedding=True,
        importance=True, block_size=_block, head_topk=_HEAD_TOPK.get(_name, 0), file_formats=frozenset({"tflite"}),
        target_refusal=_INT4_REFUSAL,
        runtimes=frozenset({"litert", "reference"}), step=_INT4_STEP,
        # odml.rms_norm inline too: its 61 composites split XNNPACK's decode graph into 62
        # partitions, each norm on LiteRT's builtin kernels; inline, a SmolLM2 decode step
        # spends ~5 % less CPU (bench/results/42-int4-decode.yaml)
        graph_inline_ops=frozenset({"rms_norm"})))

__all__ = ["BLOCKS", "BLOCKWISE", "FORMATS", "FORMS", "HYBRID", "PER_CHANNEL", "INTEGER", "ONERT_GGML_CPU_FLAGS", "WEIGHTS", "Codec", "WeightFormat", "get", "host_flags", "names", "register", "tensor_host_flags", "unregister"]
