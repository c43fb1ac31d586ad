"""The conversion pipeline: export -> fuse -> lower -> quantize -> write -> verify, each stage a
function of the previous stage's product, over one :class:`Options`.

    opts = Options(target="onert", dtype=torch.float32, quantize="q4_0")
    built = build({"main": ep}, opts, weights)        # fuse, lower, quantize, fuse linears
    write(built.models["main"], "model.circle", opts, check=verify)

Three callers, one pipeline: ``circleops.convert`` / ``save`` (circleops.pipeline.convert: one file,
:func:`run`), ``convert_graphs`` (circleops.recipes.llm: several programs into one or several
files) and the quantization report (circleops.quantize.report). Every target fact comes
from the target profile (circleops.targets), every format fact from the format registry
(circleops.quantize.formats), every runtime fact from the runtime registry (circleops.runtime).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from circleops.errors import (REPORT_BUG, CircleOpsError, ExportError, InternalError, OutputError, TargetError,
                              VerifyError)
from circleops.quantize import formats
from circleops.pipeline.report import Report, VerifyResult
from circleops import targets
from circleops.targets import PROFILES, TargetProfile, profile

# Verify tolerances, relative to max(1, max|torch output|), derived from the format: fp32
# differs from torch only by summation order; every other format gets VERIFY_STEPS of its
# rounding step at the output's scale: an fp16 ulp (2^-10 relative), bf16's (2^-7), a
# quantization format's WeightFormat.step. Measured on the sharp tiny Llama of
# tests/families.py (tests/convert/test_format_accuracy.py): fp16 2 steps, uint8 5.6,
# int16 7, q8_0 2.2, q4_0 4.1, w8 3.4. (A flat 5e-2 was 100x int16's error and 50x fp16's,
# and 1.1x uint8's on that model.)
VERIFY_STEPS = 16
FLOAT_STEP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TOLERANCE = {torch.float32: 1e-3, **{dt: VERIFY_STEPS * step for dt, step in FLOAT_STEP.items()}}


def format_tolerance(quantize: str | None, dtype: Any = torch.float32) -> float:
    """The default verify tolerance (relative to max(1, max|output|)) of a file of float
    ``dtype`` or quantization format ``quantize`` (circleops.quantize.formats)."""
    if quantize is None:
        return TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    return VERIFY_STEPS * formats.get(quantize).step


# The former flat names: an integer (PT2E) file at uint8's tolerance, a weight format at q4_0's.
INTEGER_TOLERANCE = format_tolerance("uint8")
QUANT_TOLERANCE = format_tolerance("q4_0")

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- options

@dataclass
class Options:
    """One conversion's settings, validated before (circleops.pipeline.validate)."""

    target: str
    dtype: Any = torch.float32  # the torch dtype the graph computes in
    fuse: str = "none"  # "auto" / "patterns": the pattern pass runs here (adapters act at export)
    quantize: str | None = None  # a format of circleops.quantize.formats
    threads: int | None = None  # the NUM_THREADS the file will run with (target_profile)
    integer_io: bool = False  # an integer (PT2E) graph keeps integer inputs and outputs
    runtime: str | None = None  # the verify runtime; None: no verify
    tolerance: float | None = None  # verify's, relative to max(1, max|output|); None: by dtype and format
    functionalize: bool = True  # in-place ops out before the pattern pass (a program exported as given)
    shared_weights: bool = False  # the graphs share their weights as signatures of one onert file (target_profile)
    # the options as the user gave them (circleops.options.ConvertOptions): a stage reads an
    # option that needs no resolving here, so a new option is its field and its use
    given: Any = None

    @property
    def format(self) -> str:
        return PROFILES[self.target].format

    @property
    def profile(self) -> TargetProfile:
        return target_profile(self.target, self.threads, self.shared_weights)

    @property
    def weight_format(self) -> formats.WeightFormat | None:
        """The weight-only format asked for (an IR pass after lowering), or None."""
        f = formats.get(self.quantize)
        return f if f is not None and f.kind == formats.WEIGHTS else None

    @property
    def integer_format(self) -> formats.WeightFormat | None:
        """The integer (PT2E) format asked for, or None."""
        f = formats.get(self.quantize)
        return f if f is not None and f.kind == formats.INTEGER else None

    def verify_tolerance(self) -> float | None:
        """The verify tolerance: the one asked for, else the format's (None: the dtype's)."""
        if self.tolerance is not None:
            return self.tolerance
        if self.integer_format is not None:  # at least the target's integer kernels' own deviation
            return max(format_tolerance(self.quantize), self.profile.quantized_verify_floor)
        if self.weight_format is not None:
            return format_tolerance(self.quantize)
        return None


def target_profile(target: str | TargetProfile, threads: int | None = None,
                   shared_weights: bool = False) -> TargetProfile:
    """The lowering profile of ``target`` for a file run with ``threads`` threads.

    Measured (bench/README.md, bench/onert_matmul.py): onert's 1x1 CONV_2D is a blocked
    GEMM that beats FULLY_CONNECTED for 4+ rows only with a second idle core; on one
    thread it is 1.2-3x slower for SmolLM2's 64-row linears, while a one-row lm_head (8x
    wider output) stays faster as a CONV_2D (21 vs 48 ms). So one thread keeps the latter.

    ``shared_weights``: the file's graphs are signatures of one onert file sharing every
    weight (onert 0.2.0.dev's C API). onert's CPU backend copies each constant CONV_2D filter
    (transposed, in every subgraph that uses it) while FULLY_CONNECTED reads the loaded
    weight itself: the 1B shape's fp32 split files held ~2.4x their weights once prepared
    (the prefill's 1x1 CONV_2D linears and the three lm_heads copied, bench/results/39). So
    such a file writes no linear as CONV_2D: its weights are in memory once.
    """
    p = profile(target)
    if shared_weights and p.linear_as_conv is not None:
        return replace(p, linear_as_conv=None)
    if threads == 1 and p.linear_as_conv is not None:
        p = replace(p, linear_as_conv=replace(p.linear_as_conv, min_rows=sys.maxsize))
    return p


class Tracker:
    """The stage a conversion is in (progress callback, InternalError's words) and the
    seconds each stage took."""

    def __init__(self, progress: Progress | None = None, timings: dict[str, float] | None = None):
        self.progress = progress
        self.timings = timings if timings is not None else {}
        self.current = "export"

    def say(self, name: str) -> None:
        if self.progress is not None:
            self.progress(name)

    @contextlib.contextmanager
    def stage(self, name: str, key: str | None = None, *, enter: bool = True) -> Iterator[None]:
        """Announce ``name``, and add its seconds to ``timings[key or name]``; ``enter``:
        it is the stage an internal error is reported in."""
        if enter:
            self.current = name
        self.say(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            key = key or name
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t


# --------------------------------------------------------------------------- quantize: before export

@dataclass
class WeightInputs:
    """What the quantize stage takes besides the lowered graphs, and shares between them."""

    pretrained: Any = None  # GGUF blocks to carry over (circleops.quantize.weights.Pretrained)
    importance: Any = None  # input importances for fitted block scales (circleops.quantize.importance)
    smoothing: str | None = None  # the SmoothQuant (and rotation) summary line (circleops.quantize.smooth, .rotate)
    cache: dict = field(default_factory=dict)  # blocks by source memory, shared by several graphs
    fused_cache: dict = field(default_factory=dict)  # fused linears' weights, shared by several graphs
    report: Any = None  # the QuantReport, accumulated over the graphs


def prepare_weights(model: Any, opts: Options, restore: contextlib.ExitStack, *, example_args: tuple | None = None,
                    tokenizer: Any = None, tracker: Tracker | None = None) -> WeightInputs:
    """The weight format's steps on the torch model, before export: SmoothQuant folded into
    the weights (they stay until ``restore`` closes: the file is written from them), input
    importances for fitted block scales, and a GGUF model's blocks to carry over. Each runs
    the model's own forward, before any fusion."""
    tracker = tracker or Tracker()
    weights = WeightInputs()
    fmt = opts.weight_format
    if fmt is None:
        return weights
    args = tuple(example_args) if example_args is not None else ()
    if fmt.smoothing:
        from circleops.quantize.smooth import smoothed

        with tracker.stage("smooth", enter=False), hf_export_settings(model), dense_experts(model):
            weights.smoothing = restore.enter_context(smoothed(model, args, tokenizer)).summary_line()
    if fmt.rotation:  # before the importances: they are the rotated model's inputs
        from circleops.quantize.rotate import rotated

        with tracker.stage("rotate", enter=False), hf_export_settings(model):
            line = restore.enter_context(rotated(model, tokenizer)).summary_line()
        weights.smoothing = "; ".join(filter(None, (weights.smoothing, line)))
    if fmt.importance:
        from circleops.quantize.importance import input_importance

        with tracker.stage("calibrate", enter=False), hf_export_settings(model), dense_experts(model):
            weights.importance = input_importance(model, args, tokenizer)
    weights.pretrained = pretrained_blocks(model)
    if fmt.gptq:  # the file's blocks, error-compensated over the calibration text
        from circleops.quantize.int4_gptq import gptq_blocks

        with tracker.stage("gptq", enter=False), hf_export_settings(model), dense_experts(model):
            blocks, line = gptq_blocks(model, fmt, tokenizer, weights.importance)
        weights.pretrained = {**(weights.pretrained or {}), **blocks}
        weights.smoothing = "; ".join(filter(None, (weights.smoothing, line)))
    return weights


def pretrained_blocks(model: Any) -> Any:
    """GGUF Q4_0/Q8_0 blocks the loader attached to ``model`` (circleops.sources.models), keyed by
    the memory of the parameter they came from; None when there are none."""
    from circleops.quantize.gguf import pretrained_for

    return pretrained_for(model)


def integer_weight_dtype(target: str | TargetProfile) -> str:
    """The integer weights' dtype for ``target``: int8 per channel where it computes them
    right, else uint8 per tensor (onert 0.1.0)."""
    return "int8" if profile(target).quantized_per_channel_int8 else "uint8"


@dataclass
class Calibration:
    """What PT2E calibration runs on (circleops.quantize.pt2e.calibration_samples)."""

    example_args: tuple
    count: int = 8
    data: str | os.PathLike | None = None
    tokenizer: Any = None
    vocab_size: int | None = None
    int16: Sequence[str] = ()
    progress_bar: bool = False
    recipe: Any = None  # the integer recipe (circleops.quantize.recipe.IntegerRecipe): weight bits, int16 auto
    head: tuple[str, ...] = ()  # the output head's module name: int8 weights when the others are int4
    samples: Sequence[tuple] | None = None  # the calibration inputs themselves (None: made from the above)
    fixed: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # graph input -> (min, max): fixed params


def quantize_program(ep: Any, module: Any, opts: Options, calibration: Calibration) -> tuple[Any, Any]:
    """The integer format's stage on the exported (and pattern-fused) program: PT2E's
    prepare with CircleQuantizer, calibration, convert and a new export. (converted
    module, its ExportedProgram): the file is verified against the former."""
    from circleops.quantize import pt2e

    if not opts.profile.integer_fused_ops:  # attention quantized op by op: its additive mask must be finite
        from circleops.quantize.integer.masks import finite_masks

        finite_masks(ep)
    samples = calibration.samples if calibration.samples is not None else pt2e.calibration_samples(
        calibration.example_args, calibration.count, data=calibration.data, tokenizer=calibration.tokenizer,
        vocab_size=calibration.vocab_size)
    recipe = calibration.recipe
    weight = integer_weight_dtype(opts.target)
    if recipe is not None and weight == "int8":
        weight = recipe.weight  # int4 where the recipe asks (target circle)
        if weight == "int4" and recipe.group_size:
            weight = "int4-grouped"  # rounded before PT2E (circleops.quantize.grouped)
    parts = [p for p in calibration.int16 if p.strip() and p.strip() != "auto"]

    def make(node_names: Sequence[str] = ()) -> Any:
        q = pt2e.make_quantizer(opts.quantize, weight=weight, int16=parts)
        if weight in ("int4", "int4-grouped"):
            for name in calibration.head[:1]:  # 4-bit weights: the output head stays int8
                q.set_module_name(name, opts.quantize, "int8")
        for name in node_names:
            q.set_node_name(name, "int16")
        for name, (low, high) in calibration.fixed.items():  # a KV cache several graphs share
            q.set_fixed_input(name, low, high)
        return q

    if recipe is not None and recipe.auto_mixed:
        converted, qep, mixed = pt2e.quantize_mixed(module, calibration.example_args, make, samples, exported=ep,
                                                    progress=calibration.progress_bar)
        recipe.lines.append(mixed.summary_line())
        return converted, qep
    return pt2e.quantize(module, calibration.example_args, make(), samples, exported=ep,
                         progress=calibration.progress_bar)


# --------------------------------------------------------------------------- fuse, lower, quantize

def fuse(ep: Any, opts: Options, model: Any = None, tracker: Tracker | None = None) -> tuple[Any, Any]:
    """(the program with its patterns fused, the FusionReport or None)."""
    tracker = tracker or Tracker()
    if opts.functionalize:
        from circleops.passes.functionalize import functionalize

        ep = functionalize(ep)  # before fusion, so that patterns written with in-place ops match
    if opts.fuse not in ("auto", "patterns"):
        return ep, None
    from circleops.passes.fusion import fuse_patterns

    with tracker.stage("fuse"):
        return fuse_patterns(ep, model=model)


def lower(ep: Any, opts: Options, output_names: Sequence[str] | None = None) -> Any:
    """The ir.Model of ``ep`` for the target: an integer graph for a program with
    quantize/dequantize pairs (PT2E), else the float lowering."""
    from circleops.lowering import lower_program
    from circleops.quantize.integer.lower import lower_quantized

    model = lower_quantized(ep, opts.target, dtype=opts.dtype, integer_io=opts.integer_io) \
        or lower_program(ep, opts.profile, dtype=opts.dtype)
    if output_names:
        name_outputs(model, list(output_names))
    return model


def inline_fused_ops(ep: Any, names: Any) -> int:
    """Mark every call of the circle ops ``names`` (e.g. {"attention"}) in ``ep`` to be lowered
    inline, as their reference kernel op by op, whatever the target's fused form (the
    profile's ``graph_inline_ops``: a composite whose decomposition the runtime's CPU
    delegate never takes). Returns how many calls were marked."""
    import torch

    from circleops.lowering.circle_ops import LOWERING_META
    from circleops.targets import DECOMPOSED

    targets = {getattr(torch.ops.circle, n).default for n in names}
    marked = 0
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.meta[LOWERING_META] = DECOMPOSED
            marked += 1
    return marked


def parameter_names(ep: Any) -> dict[str, Any]:
    """The exported program's parameters by name (the IR names its constants after them)."""
    return {name: ep.state_dict[name] for name in ep.graph_signature.parameters if name in ep.state_dict}


def quantize(models: Mapping[str, Any], programs: Mapping[str, Any], opts: Options, weights: WeightInputs,
             tracker: Tracker | None = None) -> Any:
    """The weight format's pass over the lowered graphs (one set of blocks shared by all),
    then the target's fused linears; the QuantReport (None without a weight format)."""
    from circleops.passes.fuse_linears import fuse_for_target

    fmt = opts.weight_format
    if fmt is not None:
        from circleops.quantize.weights import QuantReport, quantize_weights, table_keys

        with (tracker or Tracker()).stage("quantize", enter=False):
            # what export and calibration read of the mapped checkpoint goes back first: the
            # quantizer reads each weight once and pages it out when encoded, so its resident
            # set is the blocks made, not the whole checkpoint beside them (the Gemma-3-1B
            # shape's int4 convert peaked here: 4.1 GB of mapped pages + 2.5 GB of heap, issue 32)
            release_weights()
            weights.report = weights.report or QuantReport(fmt.name, form=fmt.form_for(opts.profile.format))
            # every model's tables: a split model's tied head is in its last part, the table in its first
            for name, model in models.items():
                weights.report.table_keys |= table_keys(model, parameter_names(programs[name]))
            for name, model in models.items():
                weights.report = quantize_weights(
                    model, fmt.name, parameters=parameter_names(programs[name]), pretrained=weights.pretrained,
                    cache=weights.cache, report=weights.report, importance=weights.importance,
                    file_format=opts.profile.format)
            weights.report.smoothing = weights.smoothing
    for model in models.values():  # onert: GGML q/k/v, gate/up as one FULLY_CONNECTED each
        fuse_for_target(model, opts.profile, cache=weights.fused_cache)
    return weights.report


@dataclass
class Built:
    """The pipeline's product before the write: the fused programs, their ir.Models and reports."""

    programs: dict[str, Any]
    models: dict[str, Any]
    fusion: Any = None  # the FusionReport (of the first program)
    quantization: Any = None  # the QuantReport


def build(programs: Mapping[str, Any], opts: Options, weights: WeightInputs | None = None,
          tracker: Tracker | None = None, *, lower_one: Callable[[str, Any], Any] | None = None,
          fusion_model: Any = None) -> Built:
    """fuse -> lower -> quantize over one or several exported programs (``name -> ep``).
    ``lower_one(name, ep)``: the lowering of one program (default :func:`lower`)."""
    tracker = tracker or Tracker()
    weights = weights if weights is not None else WeightInputs()
    fused, fusion = {}, None
    for name, ep in programs.items():
        fused[name], report = fuse(ep, opts, fusion_model, tracker)
        fusion = fusion if fusion is not None else report
    with tracker.stage("lower"):
        models = {name: lower_one(name, ep) if lower_one else lower(ep, opts) for name, ep in fused.items()}
    quant = quantize(models, fused, opts, weights, tracker)
    return Built(fused, models, fusion, quant)


# --------------------------------------------------------------------------- write

def too_large_message(needed: int, target: str | TargetProfile = "onert") -> str:
    """The refusal for a file past 2 GiB (``needed`` bytes) of a target whose runtime reads no
    weights after the flatbuffer."""
    p = profile(target)
    return (f"the model needs {needed} bytes (> 2 GiB) for target {p.name}; {p.runtime} 0.1.0 cannot read weights "
            f"stored after the flatbuffer (it crashes), and a flatbuffer holds at most 2 GiB. Use --target "
            f"circle for NPU compilers, or --target tflite for LiteRT, which reads that layout; or convert a "
            f"smaller model, or use --dtype fp16 with a target that allows it (circle, tflite).")


def check_size(ir_model: Any, target: str | TargetProfile) -> None:
    """Refuse a model the target cannot load, from its constants' bytes, before anything
    is packed or written (a 4 GB model fails in milliseconds, not after minutes of writing).

    Past 2 GiB the writer has to put the weights after the flatbuffer (Buffer.offset/size),
    a layout a target without ``weights_after_flatbuffer`` cannot read (onert 0.1.0 crashes
    on it, FACTS.md); Circle and TFLite targets write it.
    """
    p = profile(target)
    if p.weights_after_flatbuffer:
        return
    from circleops.serialize import writer

    needed = writer.constant_bytes(ir_model)
    if needed > targets.FLATBUFFER_LIMIT:
        raise TargetError(too_large_message(needed, p))


def write(ir_model: Any, path: str | os.PathLike, opts: Options | str | TargetProfile,
          check: Callable[[Path], None] | None = None) -> Any:
    """``write_model`` under the target's size rule: a target without
    ``weights_after_flatbuffer`` never gets the offset layout (checked from the IR first,
    then exactly by the writer before it writes). ``check(temp_path)`` runs on the complete
    file before it replaces ``path`` (verify). OSError becomes an OutputError."""
    from circleops.serialize import writer

    p = opts.profile if isinstance(opts, Options) else profile(opts)
    check_size(ir_model, p)
    try:
        if not p.weights_after_flatbuffer:
            return writer.write_model(ir_model, str(path), p.format, weights_after=False,
                                      too_large=lambda needed: too_large_message(needed, p), check=check)
        return writer.write_model(ir_model, str(path), p.format, check=check)
    except CircleOpsError:
        raise
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}. Choose an output path you can write.") from None


# --------------------------------------------------------------------------- one file: run

@dataclass
class Job:
    """What a one-file conversion (convert, save) reports and verifies against."""

    path: Path
    source: str
    parameters: int
    example_args: tuple = ()
    reference: Callable[[], list[torch.Tensor]] | None = None  # the torch outputs, computed on demand
    output_names: Sequence[str] | None = None
    fusion_model: Any = None  # the module the pattern pass may read (and verify dequantizes)
    weights: WeightInputs = field(default_factory=WeightInputs)
    tracker: Tracker = field(default_factory=Tracker)
    warnings: list[str] = field(default_factory=list)
    compare: Callable[..., VerifyResult] | None = None  # runs the file and compares (default compare_file)
    metadata: dict[str, bytes] = field(default_factory=dict)  # written into the file as it is (circleops.recipes.tasks)


def run(ep: Any, opts: Options, job: Job) -> Report:
    """The stages after export for one file: build, the atomic write, verify (a Report).

    Only CircleOpsErrors leave: anything else is a circleops bug, reported as an
    InternalError naming the stage (the lowering names the node itself).
    """
    try:
        return _run(ep, opts, job)
    except CircleOpsError:
        raise
    except Exception as err:
        raise InternalError(f"converting {job.source} for target {opts.target} failed in the {job.tracker.current} "
                            f"stage: {type(err).__name__}: {err}. {REPORT_BUG}") from err


def _with_metadata(model: Any, metadata: Mapping[str, bytes]) -> Any:
    model.metadata.update(metadata)
    return model


def _run(ep: Any, opts: Options, job: Job) -> Report:
    from circleops.dtypes import short_name
    from circleops.quantize.weights import dequantized_sources

    tracker, path = job.tracker, job.path
    built = build({"main": ep}, opts, job.weights, tracker, fusion_model=job.fusion_model,
                  lower_one=lambda _, program: _with_metadata(lower(program, opts, job.output_names), job.metadata))
    ep, ir_model, quant = built.programs["main"], built.models["main"], built.quantization
    report = Report(path=str(path), target=opts.target, format=opts.format, dtype=short_name(opts.dtype),
                    ops=op_histogram(ir_model), fused=fused_counts(ep), fusion=built.fusion, fuse=opts.fuse,
                    source=job.source, parameters=job.parameters, warnings=job.warnings, timings=tracker.timings,
                    quantization=built.quantization)
    report.inputs, report.outputs = io_specs(ir_model)
    verify_seconds = [0.0]

    def verify(tmp: Path) -> None:
        # Runs on the complete temporary file: only a file that passed replaces ``path``,
        # so a failed verify leaves a previous good file where it was.
        tracker.current = "verify"
        tracker.say("verify")
        t = time.perf_counter()
        # torch runs the weights the file holds, its linears' inputs rounded as the runtime rounds them
        from circleops.quantize import topk_head

        with dequantized_sources(quant, job.fusion_model, opts.runtime), topk_head.recording() as heads:
            expected = job.reference()
        release_weights()
        if job.compare is not None:
            report.verify = job.compare(tmp, opts.runtime, job.example_args, expected, opts.dtype,
                                        opts.verify_tolerance())
        else:  # a two-stage head's boundary candidates compared either way (topk_head.head_error)
            report.verify = compare_file(tmp, opts.runtime, job.example_args, expected, opts.dtype,
                                         opts.verify_tolerance(), heads=heads or None)
        verify_seconds[0] = time.perf_counter() - t
        if not report.verify.passed:
            v = report.verify
            raise VerifyError(
                f"the written file does not match torch: {opts.runtime} gives max abs error {v.max_abs_error:.3g} "
                f"(tolerance {v.tolerance:.3g}, max |output| {v.reference_max_abs:.3g}); nothing was written to "
                f"{path} (a file already there is unchanged). Convert without verify to inspect the file "
                "(circleops inspect), and report the model.")

    with tracker.stage("write"):
        info = write(ir_model, path, opts, check=verify if opts.runtime is not None else None)
    del ir_model, built  # the graph; the weights it points at are the model's own
    report.file_size = getattr(info, "file_bytes", 0) or path.stat().st_size
    tracker.timings["write"] -= verify_seconds[0]
    if opts.runtime is not None:
        tracker.timings["verify"] = verify_seconds[0]
    return report


def release_weights() -> None:
    """The memory-mapped weights' pages given back before verify's runtime loads the written
    file (circleops.sources.models.page_out_mapped_weights): the runtime's process and this one must
    not both hold the weights (issue 32)."""
    from circleops.sources.models import page_out_mapped_weights

    page_out_mapped_weights()


def io_specs(ir_model: Any) -> tuple[list, list]:
    """(inputs, outputs) of the main subgraph as (name, shape, dtype)."""
    sub = ir_model.subgraphs[0]
    return ([(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.inputs],
            [(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.outputs])


# --------------------------------------------------------------------------- export

def _is_hf_causal_lm(model: Any) -> bool:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, torch.nn.Module):
        return False
    return isinstance(model, transformers.PreTrainedModel) and hasattr(model, "get_output_embeddings") \
        and model.get_output_embeddings() is not None


def _has_hf_modules(module: torch.nn.Module) -> bool:
    return "transformers" in sys.modules and any(
        type(m).__module__.startswith("transformers.") for m in module.modules())


class CausalLMLogits(torch.nn.Module):
    """An HF CausalLM as ``input_ids -> logits``: the graph's one output is the logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


def export_module(model: torch.nn.Module) -> torch.nn.Module:
    """What torch.export sees: HF CausalLMs wrapped to return the logits, in eval mode."""
    model.eval()
    return CausalLMLogits(model) if _is_hf_causal_lm(model) else model


@contextlib.contextmanager
def hf_export_settings(model: Any) -> Iterator[None]:
    """No KV cache, eager attention while exporting; the user's settings come back after."""
    cfg = getattr(model, "config", None)
    if cfg is None or not _is_hf_causal_lm(model):
        yield
        return
    saved = (getattr(cfg, "use_cache", None), getattr(cfg, "_attn_implementation", None))
    cfg.use_cache = False
    cfg._attn_implementation = "eager"
    try:
        yield
    finally:
        cfg.use_cache, cfg._attn_implementation = saved


def dense_experts(model: Any) -> Any:
    """Mixture-of-experts blocks dispatch densely under export (static shapes; the same sum
    as the sparse dispatch): circleops.adapters._experts. Only for HF models."""
    if not _is_hf_causal_lm(model):
        return contextlib.nullcontext()
    from circleops.adapters import dense_experts_implementation

    return dense_experts_implementation(model)


def export(module: torch.nn.Module, example_args: tuple, *, adapters: bool = True,
           warn_list: list[str] | None = None) -> Any:
    """torch.export.export, inside ``adapters.patched_modules()`` when asked; a failure
    becomes an ExportError that says why in a line or two."""
    patches = contextlib.nullcontext()
    # The adapters patch transformers' classes: only an HF model needs them (and importing
    # them imports transformers, seconds that a conv net should not pay).
    if adapters and _has_hf_modules(module):
        from circleops.adapters import patched_modules

        patches = patched_modules(model=module)  # its own families' only: no other modeling module imported
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, _quiet_torch_logs():
        warnings.simplefilter("always")
        try:
            # torch.export prints the partial graph of a failed trace to stderr: the
            # ExportError says why in one paragraph instead.
            with patches, contextlib.redirect_stderr(stderr):
                ep = torch.export.export(module, example_args, strict=False)
        except CircleOpsError:
            raise
        except Exception as err:
            raise ExportError(_export_message(module, err)) from None
    if stderr.getvalue():
        sys.stderr.write(stderr.getvalue())
    for w in caught:
        msg = str(w.message)
        if issubclass(w.category, (DeprecationWarning, FutureWarning)) or "torch.export" in msg:
            continue
        if warn_list is not None:
            warn_list.append(msg.splitlines()[0])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return ep


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch's loggers below ERROR off while exporting (guard and symbol chatter)."""
    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    _set_levels(loggers, [logging.ERROR] * len(loggers))
    try:
        yield
    finally:
        _set_levels(loggers, saved)


def _set_levels(loggers: list[logging.Logger], levels: list[int]) -> None:
    """Each logger's level, and the loggers' cached is-enabled answers cleared once.
    ``Logger.setLevel`` clears the cache of every logger in the process on each call: over
    torch's ~260 loggers that was O(loggers^2), 0.09 s per export (a third of a tiny model's)."""
    for lg, level in zip(loggers, levels):
        lg.level = level
    if loggers:
        loggers[0].setLevel(levels[0])  # the one call that clears every logger's cache


def _export_message(module: torch.nn.Module, err: BaseException) -> str:
    name = type(module.model if isinstance(module, CausalLMLogits) else module).__name__
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    reason = lines[0] if lines else type(err).__name__
    # torch.export points at the user's code in a "File ..., line N" line: keep the last one.
    where = next((ln for ln in reversed(lines) if ln.startswith("File ") and "site-packages/torch" not in ln), None)
    if len(reason) > 300:
        reason = reason[:297] + "..."
    msg = f"torch.export failed on {name}: {type(err).__name__}: {reason}"
    if where:
        msg += f" (at {where[:200]})"
    return (msg + ". The model's forward must be traceable by torch.export: tensors in, tensors out, no "
            "data-dependent Python control flow. Try fuse='none' (--fuse none) to rule out the adapters.")


# --------------------------------------------------------------------------- lower, write, verify

# --------------------------------------------------------------------------- report, verify

def name_outputs(model: Any, names: list[str]) -> None:
    """Give the main subgraph's outputs meaningful names (``logits``), in the tensors and
    in the signature."""
    sub = model.subgraphs[0]
    if len(sub.outputs) != len(names):
        return
    taken = {t.name for t in sub.tensors}
    for idx, name in zip(sub.outputs, names):
        if name not in taken:
            sub.tensors[idx].name = name
    for sig in model.signatures:
        if sig.subgraph_index == 0 and len(sig.outputs) == len(names):
            sig.outputs = dict(zip(names, sig.outputs.values()))


def op_histogram(model: Any) -> dict[str, int]:
    """Opcode -> count in the main subgraph; composites are named by their composite."""
    counts: Counter[str] = Counter()
    for op in model.subgraphs[0].operators:
        name = op.opcode
        composite = op.options.get("name") if op.opcode == "STABLEHLO_COMPOSITE" else None
        counts[f"{name}({composite})" if composite else name] += 1
    return dict(sorted(counts.items()))


def fused_counts(ep: Any) -> dict[str, int]:
    """circle::* op -> how many nodes of the exported (and pattern-fused) graph call it."""
    counts: Counter[str] = Counter()
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "circle":
            counts[node.target.__name__.split(".")[0]] += 1
    return dict(sorted(counts.items()))


def run_torch(module: torch.nn.Module, args: tuple, model: Any) -> list[torch.Tensor]:
    ctx = hf_export_settings(model) if model is not None else contextlib.nullcontext()
    # on copies: a forward that writes into its inputs (x.mul_(2)) must not change what the
    # written file is then run on
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with ctx, torch.no_grad():
        out = module(*args)
    flat, _ = torch.utils._pytree.tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def compare_file(path: str | os.PathLike, runtime: str, inputs: Sequence[Any], expected: list[torch.Tensor],
                 dtype: torch.dtype, tolerance: float | None = None, *, heads: dict | None = None) -> VerifyResult:
    """Run ``path`` with ``runtime`` on ``inputs`` and compare with the torch outputs (``heads``: a
    two-stage head's record, circleops.quantize.topk_head.recording: the output of its shape is
    compared row by row by topk_head.head_error)."""
    import numpy as np

    from circleops.runtime import open_session

    np_inputs = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for a in inputs]
    # isolated: a runtime crash on the written file is reported, not fatal (issue 24)
    outs = open_session(runtime, path, isolated=True).run(np_inputs)
    if len(outs) != len(expected):
        raise VerifyError(f"{runtime} returned {len(outs)} outputs where torch returns {len(expected)}.")
    err, scale = 0.0, 0.0
    for got, want in zip(outs, expected):
        want64 = want.detach().to(torch.float64).numpy() if want.is_floating_point() else want.numpy()
        got64 = np.asarray(got).astype(np.float64) if np.asarray(got).dtype != object else got
        if tuple(np.shape(got64)) != tuple(want64.shape):
            raise VerifyError(f"{runtime} output shape {list(np.shape(got64))} != torch's {list(want64.shape)}.")
        g, w = np.asarray(got64, dtype=np.float64), np.asarray(want64, dtype=np.float64)
        # a NaN where torch has NaN, or torch's own infinity, is a match (softmax over an
        # all -inf row, log(0)); anything else non-finite is an error of nan
        same = (np.isnan(g) & np.isnan(w)) | (np.isinf(w) & (g == w))
        diff = np.where(same, 0.0, np.abs(g - w))
        if heads is not None and tuple(heads["approx"].shape) == tuple(w.shape):
            from circleops.quantize import topk_head

            v = w.shape[-1]
            diff = np.array([topk_head.head_error(o, a, e, int(heads["k"])) for o, a, e in zip(
                g.reshape(-1, v), heads["approx"].reshape(-1, v), heads["exact"].reshape(-1, v))])
        err = max(err, float(np.nanmax(diff)) if diff.size else 0.0)
        if np.isnan(diff).any():
            err = float("nan")
        # the tolerance scales with torch's finite outputs: an infinity must not make it infinite
        finite = np.abs(w[np.isfinite(w)])
        scale = max(scale, float(finite.max()) if finite.size else 0.0)
    rel = tolerance if tolerance is not None else TOLERANCE.get(dtype, 1e-3)
    tol = rel * max(1.0, scale)
    return VerifyResult(runtime=runtime, max_abs_error=err, tolerance=tol, reference_max_abs=scale,
                        passed=bool(err <= tol))
