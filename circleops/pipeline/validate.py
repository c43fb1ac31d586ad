"""Validating a conversion's options before any work is done: each function refuses one bad
choice with a CircleOpsError that names it and what to do, asking the target profile
(circleops.targets), the format registry (circleops.quantize.formats) and the runtime
registry (circleops.runtime) instead of comparing names.

Used by circleops.convert / save, convert_graphs, the quantization report and the CLI.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from circleops.dtypes import float_dtype, short_name
from circleops.errors import OutputError, TargetError
from circleops.options import CONVERT_DTYPES, FUSE_MODES
from circleops.quantize import formats
from circleops.runtime import choose_runtime, runtime_info
from circleops.targets import PROFILES, TARGETS, profile

_FORMAT_NAMES = {"circle": "Circle", "tflite": "TFLite"}


def validate_target(target: str, fuse: str = "none") -> tuple[str, str, str]:
    """(target, its file format, fuse) after checking both names."""
    if target not in PROFILES:
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(PROFILES)}.")
    if fuse not in FUSE_MODES:
        raise TargetError(f"unknown fuse mode {fuse!r}: choose one of {', '.join(FUSE_MODES)}.")
    return target, PROFILES[target].format, fuse


# No CPU runtime's pool (torch's OpenMP, onert, XNNPACK) is run wider; each thread reserves a
# stack, so a count past this is a typo that would exhaust memory (100000 threads: MemoryError).
MAX_THREADS = 1024


def validate_threads(threads: int | None, what: str = "threads") -> None:
    """``threads``: None or a thread count (1 .. MAX_THREADS): the NUM_THREADS a file will run
    with, or the threads a runtime / torch may use. ``what`` names it in the message."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                or not 1 <= threads <= MAX_THREADS):
        raise TargetError(f"{what}={threads!r}: give a thread count from 1 to {MAX_THREADS} (the NUM_THREADS the "
                          f"file runs with; usually the device's core count).")


def validate_quantize(quantize: str | None, target: str, int16: Sequence[str] = ()) -> str | None:
    """The quantization asked for (None: none), as the format registry knows it; errors for
    an unknown name, a target whose files cannot hold it, and ``int16`` parts (mixed
    precision) outside a uint8 graph of a target that loads INT16 tensors."""
    p = profile(target)
    if [part for part in int16 if part.strip()]:
        if quantize != "uint8" or "INT16" not in p.quantized_dtypes:
            raise TargetError(f"int16 parts ({', '.join(int16)}) mix int16 into a uint8 graph: use quantize='uint8' "
                              f"with target 'circle' (got quantize={quantize!r}, target {target!r}; onert 0.1.0 "
                              "loads no int16 tensor)")
        from circleops.quantize.pt2e import int16_parts

        int16_parts(int16)  # a bad part name fails here, before any work
    if quantize is None:
        return None
    fmt = formats.get(quantize)
    if fmt is None:
        raise TargetError(f"unknown quantize={quantize!r}: choose one of {', '.join(formats.names())}")
    if fmt.kind == formats.INTEGER:
        if not p.integer_graphs:
            raise TargetError(f"quantize={quantize!r} writes an integer Circle graph: use target 'circle' (NPU "
                              f"compilers) or 'onert' (uint8); target {target} writes float composites")
        stored = "INT8" if fmt.activations == "uint8" and p.quantized_uint8_as_int8 else fmt.activations.upper()
        if stored not in p.quantized_dtypes:
            raise TargetError(f"target {target}: {p.runtime} 0.1.0 loads no {fmt.activations} graph (measured, "
                              f"bench/onert_quantized.py): use quantize='uint8' for {target}, or target 'circle' for "
                              f"an {fmt.activations} file")
        return quantize
    if p.format not in fmt.file_formats:
        raise TargetError(f"quantize={quantize!r} {fmt.target_refusal}")
    return quantize


def integer_fuse(target: str, quantize: str | None, fuse: str) -> str:
    """The fuse mode an integer (PT2E) conversion for ``target`` runs with: a target whose
    integer graphs hold no fused op (TargetProfile.integer_fused_ops, tflite: LiteRT has no
    integer RMS_NORM / ROPE / ATTENTION and no quantized composite) quantizes the unfused
    model, every op of the norms, RoPE and attention observed ("auto" becomes "none");
    asking it for adapters or patterns is an error."""
    p = profile(target)
    if quantize not in formats.names(formats.INTEGER) or p.integer_fused_ops or fuse == "none":
        return fuse
    if fuse != "auto":
        raise TargetError(f"fuse={fuse!r} with quantize={quantize!r}: target {target}'s integer graphs hold no fused "
                          f"op ({p.runtime} has no integer RMS_NORM, ROPE or ATTENTION kernel, and no quantized "
                          "composite), so the model is quantized op by op: use fuse='auto' or 'none' (--fuse none), "
                          "or target 'circle' for integer RMS_NORM / ROPE / ATTENTION builtins")
    return "none"


def resolve_dtype(dtype: Any, model: Any) -> Any:
    """The torch dtype to convert in: ``dtype`` ("fp32", "fp16", a torch dtype) or, for
    None, the model's own (fp32 when it has none)."""
    import torch

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


def model_dtype(model: Any) -> Any:
    """The dtype of a module's first floating-point parameter (None: not a module, or none)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def resolve_runtime(verify: bool | str | None, target: str, dtype: Any = None, quantize: str | None = None,
                    notes: list[str] | None = None) -> str | None:
    """The runtime ``verify`` asks for (True: the target's own), None for no verify;
    TargetError for a runtime that cannot read the target's files. A default runtime this
    CPU cannot run the format on (circleops.runtime.choose_runtime) gives way to the
    reference interpreter, with a note appended to ``notes``."""
    if not verify:
        return None
    if verify is not True:
        from circleops.runtime import RUNTIMES

        if verify not in RUNTIMES:
            raise TargetError(f"unknown verify runtime {verify!r}: choose one of {', '.join(RUNTIMES)}.")
        info, fmt = runtime_info(str(verify)), PROFILES[target].format
        if fmt not in info.formats:
            others = [n for n in RUNTIMES if fmt in RUNTIMES[n]]
            targets = [t for t in TARGETS if PROFILES[t].format in info.formats]  # the built-in ones
            raise TargetError(f"{info.label} runs {' and '.join(_FORMAT_NAMES.get(f, f) for f in info.formats)} files "
                              f"only; target {target} writes {_FORMAT_NAMES.get(fmt, fmt)}. Verify with "
                              f"{' or '.join(others)}, or use --target {' / --target '.join(targets)}.")
    if verify == "onert" and target != "onert" and quantize in formats.names() and \
            formats.get(quantize).kind == formats.INTEGER:
        raise TargetError(f"onert 0.1.0 cannot run this integer graph: target {target} keeps every op integer, and "
                          "onert loads no int16 or int4 tensor and has no uint8 RMS_NORM, BATCH_MATMUL or STRIDED_SLICE "
                          "kernel (measured, docs/benchmarks.md). Verify it with the reference interpreter "
                          "(--runtime reference), or write --quantize uint8 --target onert (those ops stay float there)")
    # fp16 tflite too: the lowering legalizes fp16 graphs for LiteRT's CPU kernels
    # (circleops.lowering.tflite_fp16), so LiteRT runs them
    runtime, note = choose_runtime(verify, target, quantize, "verify")
    if note is not None and notes is not None:
        notes.append(note)
    return runtime


def validate_target_dtype(target: str, dtype: Any, quantize: str | None = None) -> None:
    """Refuse a dtype the target's runtime does not compute in, or a quantized format on a
    model that is not float32, before any work is done."""
    import torch

    if quantize in formats.names(formats.INTEGER) and dtype != torch.float32:
        raise TargetError(f"quantize={quantize!r} calibrates and quantizes a float32 model, but the model is "
                          f"{short_name(dtype)}: use dtype fp32 with quantize.")
    if quantize and dtype != torch.float32:
        raise TargetError(
            f"quantize={quantize!r} stores quantized weights for float32 graphs (onert's GGML and hybrid kernels "
            f"take float32 inputs), but the model is {short_name(dtype)}: use dtype fp32 with quantize.")
    p = profile(target)
    if p.allows_float(dtype):
        return
    others = [t for t in TARGETS if PROFILES[t].allows_float(dtype)]
    name = runtime_info(p.runtime).label
    if p.float_dtypes == {"float32"}:
        raise TargetError(
            f"target {target} is fp32 only: the {name} CPU runtime refuses {short_name(dtype)} tensors. "
            f"Use --dtype fp32 for {target}, or {' / '.join('--target ' + t for t in others)} for an "
            f"{short_name(dtype)} file.")
    allowed = " or ".join(short_name(float_dtype(d)) for d in sorted(p.float_dtypes, reverse=True))
    raise TargetError(
        f"target {target} writes {allowed}: {name}'s CPU kernels do not run {short_name(dtype)}. "
        f"Pass dtype='fp16' or 'fp32' (the model is cast), or use {' / '.join('--target ' + t for t in others)} "
        f"for a {short_name(dtype)} file.")


def validate_output_path(path: str | os.PathLike, fmt: str) -> Path:
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


__all__ = ["integer_fuse", "model_dtype", "resolve_dtype", "resolve_runtime", "validate_output_path", "validate_quantize",
           "validate_target", "validate_target_dtype", "validate_threads"]
