"""The Python API: ``convert`` a torch model, or ``save`` an ExportedProgram, to a file.

    import circleops
    report = circleops.convert(model, (input_ids,), "model.circle", target="onert", verify=True)
    print(report.summary())

The stages (circleops.pipeline.stages): export (inside the adapters' patches) -> pattern fusion ->
lowering for the target -> quantize -> atomic write -> optional verify (run the written file
against torch); the options are checked first (circleops.pipeline.validate). Every
user-caused failure raises a circleops.errors.CircleOpsError and leaves no file at ``path``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from circleops.dtypes import short_name
from circleops.errors import TargetError
from circleops.options import ConvertOptions
from circleops.pipeline.stages import (INTEGER_TOLERANCE, QUANT_TOLERANCE, TOLERANCE, Calibration, format_tolerance, CausalLMLogits, Job,
                                Options, Tracker, dense_experts, export, export_module, fused_counts,
                                hf_export_settings, op_histogram, parameter_names, prepare_weights,
                                pretrained_blocks, quantize_program, run, run_torch, target_profile, compare_file)
from circleops.quantize import INTEGER_FORMATS
from circleops.pipeline.report import Report
from circleops.pipeline.validate import (integer_fuse, model_dtype, resolve_dtype, resolve_runtime, validate_output_path,
                                validate_quantize, validate_target, validate_target_dtype, validate_threads)

Progress = Callable[[str], None]


def convert(model: torch.nn.Module, example_args: Sequence[Any], path: str | os.PathLike,
            options: ConvertOptions | None = None, *, tokenizer: Any = None, progress: Progress | None = None,
            **fields: Any) -> Report:
    """Export ``model`` on ``example_args`` and write it for ``target`` to ``path``.

    The options are ``options`` (circleops.options.ConvertOptions, what ``circleops convert``
    builds from its flags) or the same names as keyword arguments; ``tokenizer`` tokenizes the
    calibration text, ``progress(stage)`` is called as each stage starts. The options:

    target: "circle" (fused ops as Circle builtins, for NPU compilers), "onert" (what the
        onert CPU runtime runs; fp32 only) or "tflite" (composites with decompositions).
        The file format follows: .circle for circle/onert, .tflite for tflite.
    dtype: "fp32" / "fp16" (or a torch dtype); the model is cast in place (``Module.to``)
        before export when it differs. None keeps the model's dtype.
    fuse: "auto" (adapters for the families that have them, then the pattern pass for
        the rest), "adapters", "patterns" or "none".
    verify: run the written file and compare with torch: True picks the target's runtime
        (onert for onert, litert for tflite, reference for circle), or name one of
        "onert", "litert", "reference" (or as ``runtime``). Raises VerifyError above
        ``tolerance`` (relative to max(1, max|torch output|)).
    quantize: "q4_0" / "q4_0-pure" / "q8_0" (circleops.quantize.WEIGHT_FORMATS) store every
        linear weight with K % 32 == 0 as GGML blocks, and for q4_0 the embedding table too
        (targets onert and circle; float32 only); q4_0 keeps the output head (lm_head) at
        Q8_0, q4_0-pure at Q4_0 (a tied one sharing the table). Q4_0 block scales are fitted
        to each linear's inputs on the shipped calibration text (``tokenizer`` tokenizes it;
        circleops.quantize.importance). verify then compares with torch running the
        dequantized weights. A GGUF model's Q4_0/Q8_0 tensors are carried over as they are.
        "w8": every linear weight int8 per output channel for onert's hybrid FULLY_CONNECTED
        (float activations, the input quantized per row at run time), then a MUL by the
        channel scales; the embedding stays fp32 (circleops.quantize.int8). onert runs it on
        any x86-64 (the GGML kernels need AVX-512); verify as for the GGML formats.
        "uint8" / "int16" write an integer graph (PT2E with circleops.quantize's
        CircleQuantizer): uint8 asymmetric or int16 symmetric activations, int8 per-channel
        weights (uint8 per tensor for target onert, which runs only those), int32 biases;
        calibrated on ``calibrate`` samples (circleops.quantize.pt2e.calibration_samples:
        token windows of the shipped text via ``tokenizer`` for an LLM, the example input
        with seeded noise otherwise, or the tensors of the ``calibration_data`` .pt file).
        Verify compares with the fake-quantized torch module. ``integer_io``: the file's
        inputs and outputs stay integer (no QUANTIZE / DEQUANTIZE at the boundary).
        ``int16`` (with "uint8", target circle): parts kept at int16 activations, mixed
        precision: circleops.quantize.INT16_PARTS ("norms", "residual", ...), a preset of
        INT16_PRESETS ("llm"), or module names / globs ("*.mlp.down_proj"); "auto": the ops
        around the activations whose uint8 rounding measures worst (circleops.quantize.sensitivity).
        ``weight_bits`` 8 / 4: int8 per-channel or int4 (Circle INT4, target circle) weights; an
        LLM's lm_head stays int8. ``weight_group_size`` (4-bit): the input columns sharing a
        scale (None: 16 for an LLM, 32 otherwise; 0: per channel), rounded before PT2E and written as Circle
        BlockwiseQuantization (circleops.quantize.grouped). ``int8_weights`` "auto": the 4-bit
        linears whose rounding measures worst in the logits stay int8 per channel ("none":
        none). ``gptq``: GPTQ rounding of the weights on the calibration samples (grouped:
        ``act_order``, ``clip_search``, ``gptq_refine`` passes of coordinate descent). ``rotate``
        ("auto" / "on" / "off"): a Hadamard rotation of an LLM's residual stream folded into
        its weights (auto: Llama-shaped LLMs). Left out (None), the options take the recipes
        measured usable for an LLM (circleops.quantize.recipe.resolve_recipe: uint8 on target
        circle: int16 "auto"; 4-bit weights: the 16a4w NPU recipe, groups of 16, GPTQ with act
        order, clipping search and 2 refinement passes, int8_weights "auto"), else int8 weights
        and uint8 throughout. An LLM's summary says what the file scores on a hold-out text
        (a warning with the flags that fix it when it is not usable). The recipe is recorded
        in the file's metadata ("circleops.quantization"); see docs/integer-llm.md.
    threads: the NUM_THREADS the onert file will run with (target onert). None or 2+: linears
        of 4+ rows are 1x1 CONV_2D (onert's blocked GEMM, faster with a second core); 1: they
        stay FULLY_CONNECTED (measured faster on one thread); see bench/README.md.
    output_names: names of the file's outputs, in the order the model returns them (an HF
        CausalLM's one output is named "logits" without it). metadata: entries written into
        the file's metadata (name -> bytes), e.g. circleops.recipes.tasks' record of the source model.
    A Hugging Face CausalLM is exported as ``input_ids -> logits`` (no cache, eager attention).
    """
    plan = _resolve(ConvertOptions.of(options, fields, "convert"), model, path)
    return _convert(model, tuple(example_args), plan, tokenizer, Tracker(progress))


@dataclass
class _Plan:
    """A conversion's checked options: the pipeline's Options, the integer recipe, the path."""

    opts: Options
    recipe: Any  # circleops.quantize.recipe.IntegerRecipe of an integer format, else None
    path: Any
    notes: list[str]  # the verify runtime's host notes, reported as warnings


def _resolve(o: ConvertOptions, model: Any, path: str | os.PathLike) -> _Plan:
    """Every option checked before any work (circleops.pipeline.validate), resolved into the
    pipeline's Options."""
    from circleops.quantize.recipe import RecipeOptions, resolve_recipe

    target, fmt, fuse = validate_target(o.target, o.fuse)
    int16 = None if o.int16 is None else tuple(p.strip() for p in o.int16 if p.strip())
    quantize = validate_quantize(o.quantize, target, int16)
    fuse = integer_fuse(target, quantize, fuse)
    # the options left out (None) take the recipe measured usable for an LLM
    recipe = resolve_recipe(quantize, target, model, RecipeOptions.of(o))
    validate_threads(o.threads)
    verify = o.verify_runtime
    if o.integer_io and (quantize not in INTEGER_FORMATS or verify):
        raise TargetError("integer_io applies to integer graphs (quantize='uint8' / 'int16') written without "
                          "verify (verify compares float outputs with torch)")
    path = validate_output_path(path, fmt)
    torch_dtype = resolve_dtype(o.dtype, model)
    notes: list[str] = []
    runtime = resolve_runtime(verify, target, torch_dtype, quantize, notes)
    validate_target_dtype(target, torch_dtype, quantize)
    opts = Options(target, torch_dtype, fuse, quantize, o.threads, o.integer_io, runtime, o.tolerance, given=o)
    return _Plan(opts, recipe, path, notes)


def _convert(model: Any, example_args: tuple, plan: _Plan, tokenizer: Any, tracker: Tracker) -> Report:
    """The stages of one conversion (circleops.pipeline.stages): the weight steps, export,
    the integer format's calibration, then build, write and verify (stages.run)."""
    opts, recipe, o = plan.opts, plan.recipe, plan.opts.given
    tracker.say("export")
    t = time.perf_counter()
    if model_dtype(model) not in (None, opts.dtype):
        model.to(opts.dtype)
    with contextlib.ExitStack() as restore:  # w8's SmoothQuant weights live until the file is written
        weights = prepare_weights(model, opts, restore, example_args=example_args, tokenizer=tokenizer,
                                  tracker=tracker)
        probe = None
        if recipe is not None:  # rotation and GPTQ change the weights until the file is written
            with hf_export_settings(model), dense_experts(model):
                probe = _probe(model, example_args, tokenizer)  # fp32 logits of a hold-out text, before
                _prepare_integer_llm(model, example_args, recipe, restore, (o.calibration_data, tokenizer), tracker)
        t += sum(tracker.timings.values())
        module = export_module(model)
        job = Job(plan.path, type(model).__name__, _count_params(model), example_args,
                  reference=lambda: run_torch(module, example_args, model), fusion_model=module, weights=weights,
                  output_names=["logits"] if isinstance(module, CausalLMLogits) else o.output_names,
                  tracker=tracker, compare=compare_file, metadata=dict(o.metadata or {}))
        job.warnings.extend(plan.notes)
        with hf_export_settings(model), dense_experts(model), torch.no_grad():
            ep = export(module, example_args, adapters=opts.fuse in ("auto", "adapters"), warn_list=job.warnings)
        tracker.timings["export"] = time.perf_counter() - t
        if opts.integer_format is not None:
            calibration = _calibration(model, module, example_args, plan, tokenizer, tracker)
            ep, opts = _quantize_integer(ep, model, opts, job, calibration, probe)
            from circleops.quantize.recipe import METADATA_KEY

            job.metadata[METADATA_KEY] = recipe.metadata()
        report = run(ep, opts, job)
        if report.quantization is None and recipe is not None:
            report.quantization = recipe
        return report


def _calibration(model: Any, module: Any, example_args: tuple, plan: _Plan, tokenizer: Any,
                 tracker: Tracker) -> Calibration:
    """What PT2E calibrates on: the example input or the calibration text, the integer
    recipe, the output head (int8 when the other weights are int4)."""
    o = plan.opts.given
    head = [name for name, m in module.named_modules() if m is model.get_output_embeddings()] \
        if callable(getattr(model, "get_output_embeddings", None)) else []
    return Calibration(example_args, o.calibrate, o.calibration_data, tokenizer,
                       getattr(getattr(model, "config", None), "vocab_size", None),
                       tuple(plan.recipe.int16),
                       getattr(tracker.progress, "bar", None) is not None, plan.recipe, tuple(head))


def _prepare_integer_llm(model: Any, example_args: tuple, recipe: Any, restore: contextlib.ExitStack,
                         data_and_tokenizer: tuple, tracker: Tracker) -> None:
    """Rotation, then GPTQ / per-group rounding, of an LLM's weights (circleops.quantize.recipe.prepare_llm)."""
    from circleops.quantize.llm import prepare_llm

    prepare_llm(model, example_args, recipe, restore, data_and_tokenizer, tracker)


def _probe(model: Any, example_args: tuple, tokenizer: Any) -> Any:
    """An LLM's fp32 logits on a hold-out text (circleops.quantize.llm.probe), or None."""
    from circleops.quantize.llm import probe

    return probe(model, example_args, tokenizer)


def _quantize_integer(ep: Any, model: Any, opts: Options, job: Job, calibration: Calibration,
                      probe: Any = None) -> tuple[Any, Options]:
    """PT2E: pattern fusion first (the quantizer annotates fused ops whole), then prepare,
    calibration, convert and a new export (circleops.pipeline.stages.quantize_program); the job
    then lowers that program and verifies against the converted (fake-quantized) module.
    An LLM's converted module is scored against ``probe`` (its fp32 logits of a hold-out
    text): the summary says what the file scores, and a warning what to add if it is not usable."""
    from circleops.pipeline.stages import fuse

    ep, _ = fuse(ep, dataclasses.replace(opts, functionalize=False), job.fusion_model, job.tracker)
    with job.tracker.stage("calibrate"), hf_export_settings(model), torch.no_grad():
        converted, qep = quantize_program(ep, job.fusion_model, opts, calibration)
    if probe is not None and calibration.recipe is not None:
        from circleops.quantize.llm import score, score_line

        line, warning = score_line(calibration.recipe, opts.target, *score(probe, converted))
        calibration.recipe.lines.append(line)
        job.warnings.extend([warning] if warning else [])
    job.reference = lambda: run_torch(converted, job.example_args, None)
    return qep, dataclasses.replace(opts, fuse="none")


def save(exported_program: Any, path: str | os.PathLike, options: ConvertOptions | None = None, *,
         example_args: Sequence[Any] | None = None, progress: Progress | None = None, **fields: Any) -> Report:
    """Write an already exported program (``torch.export.export``) for ``target``.

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments, as for :func:`convert` (``fuse`` defaults to "patterns" here): target,
    dtype, fuse, verify, runtime, tolerance, quantize (a weight-only format), threads,
    integer_io. Adapters act at export time, so only the pattern pass can fuse here (``fuse``
    is "patterns" or "none"; "auto" means "patterns"). Verify runs on ``example_args``, by
    default the example inputs saved with the program.

    A program exported from torchao's ``convert_pt2e`` output (quantize/dequantize pairs,
    e.g. with circleops.quantize.CircleQuantizer) is written as an integer graph: its
    tensors are UINT8/INT8/INT16/INT32 with QuantizationParameters, with a QUANTIZE after
    each float input and a DEQUANTIZE before each output, or, with ``integer_io``, integer
    inputs and outputs. Verify then compares with the converted (fake-quantized) module.
    """
    o = ConvertOptions.of(options, fields, "save", fuse="patterns")
    plan = _resolve_save(o, exported_program, path)
    runtime = plan.opts.runtime
    if example_args is None and runtime is not None:
        from circleops.sources.models import exported_example_args

        example_args = exported_example_args(exported_program, None, "the ExportedProgram")
    args = tuple(example_args or ())
    job = Job(plan.path, "ExportedProgram", _count_params(exported_program), args,
              reference=lambda: run_torch(exported_program.module(), args, None), tracker=Tracker(progress),
              compare=compare_file)
    job.warnings.extend(plan.notes)
    return run(exported_program, plan.opts, job)


def _resolve_save(o: ConvertOptions, exported_program: Any, path: str | os.PathLike) -> _Plan:
    """save's options checked and resolved: a weight-only format at most, a fuse mode that
    applies to a program exported already, the program's own dtype."""
    from circleops.quantize.integer.qdq import has_qdq

    target, fmt, fuse = validate_target(o.target, o.fuse)
    quantize = validate_quantize(o.quantize, target)
    if quantize in INTEGER_FORMATS:
        raise TargetError(f"save writes a program as it is: for quantize={quantize!r} quantize it first "
                          "(circleops.quantize.pt2e.quantize, or torchao's prepare_pt2e/convert_pt2e with "
                          "CircleQuantizer) and save the converted program, or use circleops.convert")
    validate_threads(o.threads)
    verify, tolerance = o.verify_runtime, o.tolerance
    quantized = has_qdq(exported_program)
    if quantized:
        fuse = "none"  # fuse before prepare_pt2e: a quantized graph's patterns hold Q/DQ pairs
        if o.integer_io and verify:
            raise TargetError("verify compares float outputs with torch: write with integer_io=False to verify, "
                              "or convert without verify")
        if tolerance is None:
            tolerance = format_tolerance(_integer_scheme(exported_program))
    if fuse in ("auto", "adapters"):
        fuse = "patterns" if fuse == "auto" else "none"
    path = validate_output_path(path, fmt)
    program_dtype = _program_dtype(exported_program)
    torch_dtype = resolve_dtype(o.dtype, None) if o.dtype is not None else (program_dtype or torch.float32)
    if o.dtype is not None and program_dtype is not None and torch_dtype != program_dtype:
        raise TargetError(
            f"the ExportedProgram's weights are {short_name(program_dtype)} but dtype "
            f"{short_name(torch_dtype)} was asked: an exported graph's dtype is fixed. Cast the "
            f"model (model.to(...)) before torch.export, or use circleops.convert(model, ..., dtype=...).")
    notes: list[str] = []
    runtime = resolve_runtime(verify, target, torch_dtype, quantize, notes)
    validate_target_dtype(target, torch_dtype, quantize)
    opts = Options(target, torch_dtype, fuse, quantize, o.threads, o.integer_io, runtime, tolerance, given=o)
    return _Plan(opts, None, path, notes)


def _integer_scheme(ep: Any) -> str:
    """The coarsest activation format of a converted PT2E program: "int16" when every
    quantize node rounds to 16 bits, else "uint8" (an 8-bit step, uint8 or int8)."""
    for node in ep.graph.nodes:
        if node.op == "call_function" and "quantize_per_tensor" in str(node.target) \
                and "dequantize" not in str(node.target):
            if any(a in (torch.uint8, torch.int8) for a in node.args):
                return "uint8"
    return "int16"


def _program_dtype(ep: Any) -> torch.dtype | None:
    for t in ep.state_dict.values():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


def _count_params(obj: Any) -> int:
    if isinstance(obj, torch.nn.Module):
        return sum(p.numel() for p in obj.parameters())
    try:
        return sum(t.numel() for t in obj.state_dict.values())
    except AttributeError:
        return 0


# The option checks under their former names (circleops.pipeline.validate has them now).
check_quantize = validate_quantize
check_target_dtype = validate_target_dtype
check_output_path = validate_output_path
check_threads = validate_threads

__all__ = ["INTEGER_TOLERANCE", "QUANT_TOLERANCE", "TOLERANCE", "format_tolerance", "CausalLMLogits", "convert", "export",
           "export_module", "fused_counts", "hf_export_settings", "model_dtype", "op_histogram", "parameter_names",
           "pretrained_blocks", "resolve_runtime", "save", "target_profile", "compare_file"]
