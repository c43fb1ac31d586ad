"""The Python API: ``convert`` a torch model, or ``save`` an ExportedProgram, to a file.

    import circleops
    report = circleops.convert(model, (input_ids,), "model.circle", target="onert", verify=True)
    print(report.summary())

The stages: export (inside the adapters' patches) -> pattern fusion -> lowering for the
target -> atomic write -> optional verify (run the written file against torch). Every
user-caused failure raises a circleops.errors.CircleOpsError and leaves no file at ``path``.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from circleops.dtypes import float_dtype, short_name
from circleops.errors import (REPORT_BUG, CircleOpsError, ExportError, InternalError, OutputError, TargetError,
                              VerifyError)
from circleops.options import CONVERT_DTYPES, FUSE_MODES
from circleops.quantize import GGML_FORMATS, HYBRID_FORMATS, INTEGER_FORMATS
from circleops.quantize.weights import dequantized_sources
from circleops.report import Report, VerifyResult
from circleops.runtime import RUNTIMES
from circleops.targets import PROFILES, TARGETS

# Verify tolerance, relative to max(1, max|torch output|): fp32 differs from torch only
# by summation order; an fp16 graph rounds every intermediate.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}

Progress = Callable[[str], None]


def convert(model: torch.nn.Module, example_args: Sequence[Any], path: str | os.PathLike, *,
            target: str = "circle", dtype: str | torch.dtype | None = None, fuse: str = "auto",
            verify: bool | str = False, tolerance: float | None = None,
            progress: Progress | None = None, quantize: str | None = None, calibrate: int = 8,
            calibration_data: str | os.PathLike | None = None, tokenizer: Any = None,
            integer_io: bool = False, threads: int | None = None, int16: Sequence[str] = ()) -> Report:
    """Export ``model`` on ``example_args`` and write it for ``target`` to ``path``.

    target: "circle" (fused ops as Circle builtins, for NPU compilers), "onert" (what the
        onert CPU runtime runs; fp32 only) or "tflite" (composites with decompositions).
        The file format follows: .circle for circle/onert, .tflite for tflite.
    dtype: "fp32" / "fp16" (or a torch dtype); the model is cast in place (``Module.to``)
        before export when it differs. None keeps the model's dtype.
    fuse: "auto" (adapters for the families that have them, then the pattern pass for
        the rest), "adapters", "patterns" or "none".
    verify: run the written file and compare with torch: True picks the target's runtime
        (onert for onert, litert for tflite, reference for circle), or name one of
        "onert", "litert", "reference". Raises VerifyError above ``tolerance`` (relative
        to max(1, max|torch output|)).
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
        INT16_PRESETS ("llm"), or module names / globs ("*.mlp.down_proj").
    threads: the NUM_THREADS the onert file will run with (target onert). None or 2+: linears
        of 4+ rows are 1x1 CONV_2D (onert's blocked GEMM, faster with a second core); 1: they
        stay FULLY_CONNECTED (measured faster on one thread); see bench/README.md.
    A Hugging Face CausalLM is exported as ``input_ids -> logits`` (no cache, eager attention).
    """
    target, fmt, fuse = _check_options(target, fuse)
    quantize = check_quantize(quantize, target, int16)
    check_threads(threads)
    if integer_io and (quantize not in INTEGER_FORMATS or verify):
        raise TargetError("integer_io applies to integer graphs (quantize='uint8' / 'int16') written without "
                          "verify (verify compares float outputs with torch)")
    path = check_output_path(path, fmt)
    torch_dtype = _resolve_dtype(dtype, model)
    host_notes: list[str] = []
    runtime = resolve_runtime(verify, target, torch_dtype, quantize, host_notes)
    check_target_dtype(target, torch_dtype, quantize)
    example_args = tuple(example_args)

    _stage(progress, "export")
    t = time.perf_counter()
    if model_dtype(model) not in (None, torch_dtype):
        model.to(torch_dtype)
    with contextlib.ExitStack() as restore:  # w8's SmoothQuant weights live until the file is written
        smoothing = None
        if quantize in HYBRID_FORMATS:
            from circleops.quantize.smooth import smoothed

            t_smooth = time.perf_counter()
            with hf_export_settings(model), _dense_experts(model):  # the model's own forward, before fusion
                smoothing = restore.enter_context(smoothed(model, example_args, tokenizer)).summary_line()
            t_smooth = time.perf_counter() - t_smooth
            t += t_smooth
        return _convert_exported(model, example_args, path, target, fmt, torch_dtype, fuse, runtime, tolerance,
                                 progress, quantize, calibrate, calibration_data, tokenizer, integer_io, threads,
                                 int16, host_notes, t, smoothing, t_smooth if smoothing else None)


def _convert_exported(model, example_args, path, target, fmt, torch_dtype, fuse, runtime, tolerance, progress,
                      quantize, calibrate, calibration_data, tokenizer, integer_io, threads, int16, host_notes, t,
                      smoothing, t_smooth) -> Report:
    """convert after the checks: export, calibrate, lower, write, verify."""
    module = export_module(model)
    importance = None
    if quantize in GGML_FORMATS and GGML_FORMATS[quantize] == "GGML_Q4_0":
        from circleops.quantize.importance import input_importance

        t_imp = time.perf_counter()
        with hf_export_settings(model), _dense_experts(model):  # the model's own forward, before fusion
            importance = input_importance(model, example_args, tokenizer)
        t_imp = time.perf_counter() - t_imp
        t += t_imp
    job = _Job(path, target, fmt, torch_dtype, fuse, runtime, tolerance, example_args,
               reference=lambda: _run_torch(module, example_args, model), progress=progress,
               source=type(model).__name__, parameters=_count_params(model),
               output_names=["logits"] if isinstance(module, CausalLMLogits) else None, fusion_model=module,
               quantize=quantize, pretrained=pretrained_blocks(model) if quantize else None, threads=threads,
               importance=importance)
    job.warnings.extend(host_notes)
    job.smoothing = smoothing
    if importance is not None:
        job.timings["calibrate"] = t_imp
    if t_smooth is not None:
        job.timings["smooth"] = t_smooth
    with hf_export_settings(model), _dense_experts(model), torch.no_grad():
        ep = export(module, example_args, adapters=fuse in ("auto", "adapters"), warn_list=job.warnings)
    job.timings["export"] = time.perf_counter() - t
    if quantize in INTEGER_FORMATS:
        job.quantize, job.pretrained, job.integer_io = None, None, integer_io
        return _lower_write_verify(_quantize_integer(model, module, ep, job, quantize, calibrate,
                                                     calibration_data, tokenizer, int16), job)
    return _lower_write_verify(ep, job)


def _quantize_integer(model: Any, module: torch.nn.Module, ep: Any, job: "_Job", scheme: str, calibrate: int,
                      data: Any, tokenizer: Any, int16: Sequence[str] = ()) -> Any:
    """PT2E: pattern fusion first (the quantizer annotates fused ops whole), then
    prepare_pt2e with CircleQuantizer, calibration, convert_pt2e and a new export; the job
    then lowers that program and verifies against the converted (fake-quantized) module."""
    from circleops.quantize import pt2e

    if job.fuse in ("auto", "patterns"):
        _stage(job.progress, "fuse")
        t = time.perf_counter()
        from circleops.passes.fusion import fuse_patterns

        ep, _ = fuse_patterns(ep, model=job.fusion_model)
        job.timings["fuse"] = time.perf_counter() - t
    job.fuse = "none"
    _stage(job.progress, "calibrate")
    t = time.perf_counter()
    config = getattr(model, "config", None)
    samples = pt2e.calibration_samples(job.example_args, calibrate, data=data, tokenizer=tokenizer,
                                       vocab_size=getattr(config, "vocab_size", None))
    quantizer = pt2e.make_quantizer(scheme, weight="uint8" if job.target == "onert" else "int8", int16=int16)
    with hf_export_settings(model), torch.no_grad():
        converted, qep = pt2e.quantize(module, job.example_args, quantizer, samples, exported=ep,
                                       progress=getattr(job.progress, "bar", None) is not None)
    job.reference = lambda: _run_torch(converted, job.example_args, None)
    if job.tolerance is None:
        job.tolerance = INTEGER_TOLERANCE
    job.timings["calibrate"] = time.perf_counter() - t
    return qep


def save(exported_program: Any, path: str | os.PathLike, *, target: str = "circle",
         dtype: str | torch.dtype | None = None, fuse: str = "patterns", verify: bool | str = False,
         example_args: Sequence[Any] | None = None, tolerance: float | None = None,
         progress: Progress | None = None, integer_io: bool = False, quantize: str | None = None,
         threads: int | None = None) -> Report:
    """Write an already exported program (``torch.export.export``) for ``target``.

    Adapters act at export time, so only the pattern pass can fuse here (``fuse`` is
    "patterns" or "none"; "auto" means "patterns"). Verify runs on ``example_args``, by
    default the example inputs saved with the program.

    A program exported from torchao's ``convert_pt2e`` output (quantize/dequantize pairs,
    e.g. with circleops.quantize.CircleQuantizer) is written as an integer graph: its
    tensors are UINT8/INT8/INT16/INT32 with QuantizationParameters, with a QUANTIZE after
    each float input and a DEQUANTIZE before each output, or, with ``integer_io``, integer
    inputs and outputs. Verify then compares with the converted (fake-quantized) module.
    """
    target, fmt, fuse = _check_options(target, fuse)
    quantize = check_quantize(quantize, target)
    if quantize in INTEGER_FORMATS:
        raise TargetError(f"save writes a program as it is: for quantize={quantize!r} quantize it first "
                          "(circleops.quantize.pt2e.quantize, or torchao's prepare_pt2e/convert_pt2e with "
                          "CircleQuantizer) and save the converted program, or use circleops.convert")
    check_threads(threads)
    from circleops.passes.qdq import has_qdq

    quantized = has_qdq(exported_program)
    if quantized:
        fuse = "none"  # fuse before prepare_pt2e: a quantized graph's patterns hold Q/DQ pairs
        if integer_io and verify:
            raise TargetError("verify compares float outputs with torch: write with integer_io=False to verify, "
                              "or convert without verify")
    if fuse in ("auto", "adapters"):
        fuse = "patterns" if fuse == "auto" else "none"
    path = check_output_path(path, fmt)
    program_dtype = _program_dtype(exported_program)
    torch_dtype = _resolve_dtype(dtype, None) if dtype is not None else (program_dtype or torch.float32)
    if dtype is not None and program_dtype is not None and torch_dtype != program_dtype:
        raise TargetError(
            f"the ExportedProgram's weights are {short_name(program_dtype)} but dtype "
            f"{short_name(torch_dtype)} was asked: an exported graph's dtype is fixed. Cast the "
            f"model (model.to(...)) before torch.export, or use circleops.convert(model, ..., dtype=...).")
    host_notes: list[str] = []
    runtime = resolve_runtime(verify, target, torch_dtype, quantize, host_notes)
    check_target_dtype(target, torch_dtype, quantize)
    if example_args is None and runtime is not None:
        from circleops.models import exported_example_args

        example_args = exported_example_args(exported_program, None, "the ExportedProgram")
    args = tuple(example_args or ())
    job = _Job(path, target, fmt, torch_dtype, fuse, runtime, tolerance, args,
               reference=lambda: _run_torch(exported_program.module(), args, None), progress=progress,
               source="ExportedProgram", parameters=_count_params(exported_program), quantize=quantize,
               threads=threads)
    job.warnings.extend(host_notes)
    job.integer_io = integer_io
    if quantized and tolerance is None:
        job.tolerance = INTEGER_TOLERANCE
    return _lower_write_verify(exported_program, job)


# Verify tolerance of an integer (PT2E) file against the fake-quantized torch module,
# relative to max(1, max|output|): the integer kernels round each requantization once
# where torch rounds in float (a few output steps at most; measured 1-2 on tiny models).
INTEGER_TOLERANCE = 5e-2


# Verify tolerance of a GGML-quantized file, relative to max(1, max|torch output|): torch
# runs the same dequantized weights, but onert's kernel also rounds each linear's input to
# Q8_0 (8 bits per 32-value block), which torch does not.
QUANT_TOLERANCE = 5e-2


# --------------------------------------------------------------------------- options

def check_threads(threads: int | None) -> None:
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise TargetError(f"threads={threads!r}: give the NUM_THREADS the file will run with (1, 2, ...)")


def target_profile(target: str, threads: int | None = None) -> Any:
    """The lowering profile of ``target`` for a file run with ``threads`` onert threads.

    Measured (bench/README.md, bench/onert_matmul.py): onert's 1x1 CONV_2D is a blocked
    GEMM that beats FULLY_CONNECTED for 4+ rows only with a second idle core; on one
    thread it is 1.2-3x slower for SmolLM2's 64-row linears, while a one-row lm_head (8x
    wider output) stays faster as a CONV_2D (21 vs 48 ms). So one thread keeps the latter.
    """
    import dataclasses

    from circleops.targets import profile

    p = profile(target)
    if threads == 1 and p.linear_as_conv is not None:
        p = dataclasses.replace(p, linear_as_conv=dataclasses.replace(p.linear_as_conv, min_rows=sys.maxsize))
    return p


def check_quantize(quantize: str | None, target: str, int16: Sequence[str] = ()) -> str | None:
    """The quantization asked for (None: none): a GGML format or an integer scheme
    (circleops.quantize.INTEGER_FORMATS); errors for a bad choice or target, and for
    ``int16`` parts (mixed precision) outside a uint8 graph for target circle."""
    if [p for p in int16 if p.strip()]:
        if quantize != "uint8" or target != "circle":
            raise TargetError(f"int16 parts ({', '.join(int16)}) mix int16 into a uint8 graph: use quantize='uint8' "
                              f"with target 'circle' (got quantize={quantize!r}, target {target!r}; onert 0.1.0 "
                              "loads no int16 tensor)")
        from circleops.quantize.pt2e import int16_parts

        int16_parts(int16)  # a bad part name fails here, before any work
    if quantize in INTEGER_FORMATS:
        if target == "tflite":
            raise TargetError(f"quantize={quantize!r} writes an integer Circle graph: use target 'circle' (NPU "
                              "compilers) or 'onert' (uint8); target tflite writes float composites")
        if target == "onert" and quantize == "int16":
            raise TargetError("target onert: onert 0.1.0 loads no int16 graph (measured, bench/onert_quantized.py): "
                              "use quantize='uint8' for onert, or target 'circle' for an int16 file")
        return quantize
    from circleops.quantize.weights import check_format

    return check_format(quantize, target)


def parameter_names(ep: Any) -> dict[str, Any]:
    """The exported program's parameters by name (the IR names its constants after them)."""
    return {name: ep.state_dict[name] for name in ep.graph_signature.parameters if name in ep.state_dict}


def pretrained_blocks(model: Any) -> Any:
    """GGUF Q4_0/Q8_0 blocks the loader attached to ``model`` (circleops.models), keyed by
    the memory of the parameter they came from; None when there are none."""
    from circleops.quantize.gguf import pretrained_for

    return pretrained_for(model)


def _check_options(target: str, fuse: str) -> tuple[str, str, str]:
    if target not in TARGETS:
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}.")
    if fuse not in FUSE_MODES:
        raise TargetError(f"unknown fuse mode {fuse!r}: choose one of {', '.join(FUSE_MODES)}.")
    return target, PROFILES[target].format, fuse


def _resolve_dtype(dtype: str | torch.dtype | None, model: torch.nn.Module | None) -> torch.dtype:
    if dtype is None:
        return model_dtype(model) or torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16):
            raise TargetError(f"dtype {dtype} is not supported: use fp32 or fp16.")
        return dtype
    resolved = float_dtype(dtype)
    if resolved is None or short_name(resolved) not in CONVERT_DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}: use fp32 or fp16.")
    return resolved


def resolve_runtime(verify: bool | str | None, target: str, dtype: torch.dtype = torch.float32,
                    quantize: str | None = None, notes: list[str] | None = None) -> str | None:
    """The runtime ``verify`` asks for (True: the target's own), None for no verify;
    TargetError for a runtime that cannot read the target's files. GGML weights on a CPU
    whose onert cannot run them (circleops.runtime.host): the reference interpreter
    instead of a default onert, with a note appended to ``notes``."""
    if not verify:
        return None
    note = None
    if target == "onert" and (verify is True or verify == "onert"):
        from circleops.runtime.host import onert_or_reference

        note = onert_or_reference(verify, quantize)[1]
        if note is not None and notes is not None:
            notes.append(note)
    if verify is True:
        # fp16 tflite too: the lowering legalizes fp16 graphs for LiteRT's CPU kernels
        # (circleops.lowering.tflite_fp16), so LiteRT runs them
        return PROFILES[target].runtime if note is None else "reference"
    if verify not in RUNTIMES:
        raise TargetError(f"unknown verify runtime {verify!r}: choose one of {', '.join(RUNTIMES)}.")
    if verify == "litert" and target != "tflite":
        raise TargetError(f"LiteRT runs TFLite files only; target {target} writes Circle. Verify with "
                          f"onert or reference, or use --target tflite.")
    if verify == "onert" and target == "tflite":
        raise TargetError("onert runs Circle files; target tflite writes TFLite. Verify with litert or reference.")
    return verify


def check_target_dtype(target: str, dtype: torch.dtype, quantize: str | None = None) -> None:
    """onert computes in fp32 only (FACTS.md): refuse fp16 before any work is done."""
    if quantize in INTEGER_FORMATS and dtype != torch.float32:
        raise TargetError(f"quantize={quantize!r} calibrates and quantizes a float32 model, but the model is "
                          f"{short_name(dtype)}: use dtype fp32 with quantize.")
    if quantize and dtype != torch.float32:
        raise TargetError(
            f"quantize={quantize!r} stores quantized weights for float32 graphs (onert's GGML and hybrid kernels "
            f"take float32 inputs), but the model is {short_name(dtype)}: use dtype fp32 with quantize.")
    if target == "onert" and dtype != torch.float32:
        raise TargetError(
            f"target onert is fp32 only: the onert CPU runtime refuses {short_name(dtype)} tensors. "
            f"Use --dtype fp32 for onert, or --target circle / --target tflite for an fp16 file.")
    if target == "tflite" and dtype not in (torch.float32, torch.float16):
        # measured: LiteRT's CPU kernels refuse bf16 (FULLY_CONNECTED at prepare)
        raise TargetError(
            f"target tflite writes fp32 or fp16: LiteRT's CPU kernels do not run {short_name(dtype)}. "
            f"Pass dtype='fp16' or 'fp32' (the model is cast), or use --target circle for a bf16 file.")


def onert_too_large(needed: int) -> str:
    """The refusal for a target onert file past 2 GiB (``needed`` bytes)."""
    return (f"the model needs {needed} bytes (> 2 GiB) for target onert; onert 0.1.0 cannot read weights "
            f"stored after the flatbuffer (it crashes), and a flatbuffer holds at most 2 GiB. Use --target "
            f"circle for NPU compilers, or --target tflite for LiteRT, which reads that layout; or convert a "
            f"smaller model, or use --dtype fp16 with a target that allows it (circle, tflite).")


def check_file_size(ir_model: Any, target: str) -> None:
    """Refuse a model target onert cannot load, from its constants' bytes, before anything
    is packed or written (a 4 GB model fails in milliseconds, not after minutes of writing).

    Past 2 GiB the writer has to put the weights after the flatbuffer (Buffer.offset/size),
    a layout onert 0.1.0 crashes on (FACTS.md); Circle and TFLite targets write it.
    """
    if target != "onert":
        return
    from circleops.serialize import writer

    needed = writer.constant_bytes(ir_model)
    if needed > writer.FLATBUFFER_LIMIT:
        raise TargetError(onert_too_large(needed))


def write_for_target(ir_model: Any, path: str | os.PathLike, target: str, fmt: str,
                     check: Callable[[Path], None] | None = None) -> Any:
    """``write_model`` under the target's size rule: target onert never gets the offset
    layout (checked from the IR first, then exactly by the writer before it writes).
    ``check(temp_path)`` runs on the complete file before it replaces ``path`` (verify)."""
    from circleops.serialize import writer

    check_file_size(ir_model, target)
    if target == "onert":
        return writer.write_model(ir_model, str(path), fmt, weights_after=False, too_large=onert_too_large,
                                  check=check)
    return writer.write_model(ir_model, str(path), fmt, check=check)


def check_output_path(path: str | os.PathLike, fmt: str) -> Path:
    """Refuse an output path that cannot be written, before the (slow) conversion runs."""
    p = Path(path)
    suffix = p.suffix.lower()
    other = {"circle": ".tflite", "tflite": ".circle"}[fmt]
    if suffix == other:
        raise OutputError(
            f"output {p} has the extension {suffix} but the target writes a .{fmt} file. Use "
            f"-o {p.with_suffix('.' + fmt)}" + (" or --target tflite." if fmt == "circle" else " or --target circle."))
    if p.is_dir():
        raise OutputError(f"output {p} is a directory: give a file path such as {p / ('model.' + fmt)}.")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"cannot write {p}: the directory {parent} does not exist. Create it first.")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OutputError(f"cannot write {p}: permission denied. Choose an output path you can write.")
    return p


def model_dtype(model: Any) -> torch.dtype | None:
    """The dtype of a module's first floating-point parameter (None: not a module, or none)."""
    if not isinstance(model, torch.nn.Module):
        return None
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


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


def _stage(progress: Progress | None, name: str) -> None:
    if progress is not None:
        progress(name)


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


def _dense_experts(model: Any) -> Any:
    """Mixture-of-experts blocks dispatch densely under export (static shapes; the same sum
    as the sparse dispatch): circleops.adapters._experts. Only for HF models."""
    if not _is_hf_causal_lm(model):
        return contextlib.nullcontext()
    from circleops.adapters._experts import dense_experts_implementation

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

        patches = patched_modules()
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
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


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

@dataclass
class _Job:
    """One conversion's settings and what it has measured so far."""

    path: Path
    target: str
    fmt: str
    dtype: torch.dtype
    fuse: str
    runtime: str | None
    tolerance: float | None
    example_args: tuple
    reference: Callable[[], list[torch.Tensor]]  # the torch outputs, computed on demand
    progress: Progress | None
    source: str
    parameters: int
    output_names: list[str] | None = None
    fusion_model: torch.nn.Module | None = None
    quantize: str | None = None  # a weight-only format (circleops.quantize.WEIGHT_ONLY_FORMATS)
    pretrained: Any = None  # GGUF blocks to carry over (circleops.quantize.weights.Pretrained)
    importance: Any = None  # input importances for Q4_0 scales (circleops.quantize.importance)
    smoothing: str | None = None  # w8: the SmoothQuant summary line (circleops.quantize.smooth)
    threads: int | None = None  # the NUM_THREADS an onert file will run with (target_profile)
    integer_io: bool = False  # an integer (PT2E) graph keeps integer inputs and outputs
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    stage: str = "fuse"


def _lower_write_verify(ep: Any, job: _Job) -> Report:
    """Pattern fusion, lowering, the atomic write and verify: the stages after export.

    Only CircleOpsErrors leave: anything else is a circleops bug, reported as an
    InternalError naming the stage (the lowering names the node itself).
    """
    try:
        return _run_stages(ep, job)
    except CircleOpsError:
        raise
    except Exception as err:
        raise InternalError(f"converting {job.source} for target {job.target} failed in the {job.stage} stage: "
                            f"{type(err).__name__}: {err}. {REPORT_BUG}") from err


def _enter(job: _Job, stage: str) -> None:
    job.stage = stage
    _stage(job.progress, stage)


def _run_stages(ep: Any, job: _Job) -> Report:
    timings, path = job.timings, job.path
    fusion_report = None
    from circleops.passes.functionalize import functionalize

    ep = functionalize(ep)  # before fusion, so that patterns written with in-place ops match
    if job.fuse in ("auto", "patterns"):
        _enter(job, "fuse")
        t = time.perf_counter()
        from circleops.passes.fusion import fuse_patterns

        ep, fusion_report = fuse_patterns(ep, model=job.fusion_model)
        timings["fuse"] = time.perf_counter() - t

    _enter(job, "lower")
    t = time.perf_counter()
    from circleops.lowering import lower_program

    from circleops.lowering.integer import lower_quantized

    ir_model = lower_quantized(ep, job.target, dtype=job.dtype, integer_io=job.integer_io) \
        or lower_program(ep, target_profile(job.target, job.threads), dtype=job.dtype)
    if job.output_names:
        _name_outputs(ir_model, job.output_names)
    timings["lower"] = time.perf_counter() - t
    quant_report = None
    if job.quantize:
        _stage(job.progress, "quantize")
        t = time.perf_counter()
        from circleops.quantize.weights import quantize_weights

        quant_report = quantize_weights(ir_model, job.quantize, parameters=parameter_names(ep),
                                        pretrained=job.pretrained, importance=job.importance)
        quant_report.smoothing = job.smoothing
        timings["quantize"] = time.perf_counter() - t
    from circleops.passes.fuse_linears import fuse_for_target

    fuse_for_target(ir_model, target_profile(job.target, job.threads))  # onert: GGML q/k/v, gate/up as one FC

    report = Report(path=str(path), target=job.target, format=job.fmt, dtype=short_name(job.dtype),
                    ops=op_histogram(ir_model), fused=fused_counts(ep), fusion=fusion_report, fuse=job.fuse,
                    source=job.source, parameters=job.parameters, warnings=job.warnings, timings=timings,
                    quantization=quant_report)
    sub = ir_model.subgraphs[0]
    report.inputs = [(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.inputs]
    report.outputs = [(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.outputs]

    _enter(job, "write")
    t = time.perf_counter()
    verify_seconds = [0.0]

    def verify(tmp: Path) -> None:
        # Runs on the complete temporary file: only a file that passed replaces ``path``,
        # so a failed verify leaves a previous good file where it was.
        _enter(job, "verify")
        t_verify = time.perf_counter()
        with dequantized_sources(quant_report, job.fusion_model):  # torch runs the weights the file holds
            expected = job.reference()
        tolerance = job.tolerance if job.tolerance is not None or not job.quantize else QUANT_TOLERANCE
        report.verify = verify_file(tmp, job.runtime, job.example_args, expected, job.dtype, tolerance)
        verify_seconds[0] = time.perf_counter() - t_verify
        if not report.verify.passed:
            v = report.verify
            raise VerifyError(
                f"the written file does not match torch: {job.runtime} gives max abs error {v.max_abs_error:.3g} "
                f"(tolerance {v.tolerance:.3g}, max |output| {v.reference_max_abs:.3g}); nothing was written to "
                f"{path} (a file already there is unchanged). Convert without verify to inspect the file "
                "(circleops inspect), and report the model.")

    try:
        info = write_for_target(ir_model, path, job.target, job.fmt,
                                check=verify if job.runtime is not None else None)
    except CircleOpsError:
        raise
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}. Choose an output path you can write.") from None
    del ir_model  # the graph; the weights it points at are the model's own
    report.file_size = getattr(info, "file_bytes", 0) or path.stat().st_size
    timings["write"] = time.perf_counter() - t - verify_seconds[0]
    if job.runtime is not None:
        timings["verify"] = verify_seconds[0]
    return report


def _name_outputs(model: Any, names: list[str]) -> None:
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


def _run_torch(module: torch.nn.Module, args: tuple, model: Any) -> list[torch.Tensor]:
    ctx = hf_export_settings(model) if model is not None else contextlib.nullcontext()
    # on copies: a forward that writes into its inputs (x.mul_(2)) must not change what the
    # written file is then run on
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with ctx, torch.no_grad():
        out = module(*args)
    flat, _ = torch.utils._pytree.tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def verify_file(path: str | os.PathLike, runtime: str, inputs: Sequence[Any], expected: list[torch.Tensor],
                dtype: torch.dtype, tolerance: float | None = None) -> VerifyResult:
    """Run ``path`` with ``runtime`` on ``inputs`` and compare with the torch outputs."""
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
