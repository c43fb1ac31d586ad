"""Full-integer models the PyTorch way: PT2E with :class:`CircleQuantizer`.

    ep = circleops.quantize.pt2e.quantize(model_or_module, example_args, "uint8", samples)
    circleops.save(ep, "model.circle")       # integer tensors with QuantizationParameters

``quantize`` exports (unless given a GraphModule already), runs torchao's
``prepare_pt2e`` with CircleQuantizer, calibrates on ``samples`` (a progress bar), runs
``convert_pt2e`` and exports the converted module again: that ExportedProgram holds the
quantize/dequantize pairs that circleops.quantize.integer.qdq folds into tensor parameters.
Calibration samples: :func:`calibration_samples` (LLMs: token windows of the text shipped
in circleops/quantize/calibration.txt; other models: the example input with seeded noise,
or tensors from a ``.pt`` file).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from circleops.errors import CircleOpsError
from circleops.quantize.quantizer import ACTIVATIONS, QuantizeConfigError, torchao_pt2e
from circleops.inputs.token_ids import check_token_ids

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")


class CalibrationError(CircleOpsError):
    """Calibration data that cannot be used for the model."""


def make_quantizer(scheme: str, *, weight: str = "int8", int16_ops: Iterable[Any] = (),
                   int16_modules: Iterable[str] = (), int16: Iterable[str] = ()) -> Any:
    """A CircleQuantizer for ``scheme`` ("uint8" / "int16") with optional int16 layers:
    ``int16_ops`` by operator type, ``int16_modules`` by module name (or glob), ``int16``
    by part name (circleops.quantize.INT16_PARTS / INT16_PRESETS, or module names)."""
    from circleops.quantize.quantizer import CircleQuantizer

    if scheme not in ACTIVATIONS:
        raise QuantizeConfigError(f"integer scheme {scheme!r} is not offered: choose one of {', '.join(ACTIVATIONS)}")
    ops, modules = int16_parts(int16)
    q = CircleQuantizer(scheme, weight)
    for op in [*int16_ops, *ops]:
        q.set_operator_type(op, "int16")
    for name in [*int16_modules, *modules]:
        q.set_module_name(name, "int16")
    return q


def int16_parts(parts: Iterable[str]) -> tuple[list[Any], list[str]]:
    """(operator types, module names) that the ``--int16`` parts stand for."""
    import circleops.ops  # noqa: F401 - registers torch.ops.circle.* (a fresh CLI process has not yet)
    from circleops.quantize import INT16_PARTS, INT16_PRESETS

    aten, circle = torch.ops.aten, torch.ops.circle
    by_op: dict[str, list[Any]] = {
        "norms": [circle.rms_norm, circle.instance_norm, aten.layer_norm.default, aten.instance_norm.default],
        "residual": [aten.add.Tensor],
        "embedding": [aten.embedding.default],
        "attention": [circle.attention],
    }
    by_module = {"mlp": ["*.mlp"], "mlp_out": ["*.mlp.down_proj"], "lm_head": ["*lm_head"]}
    assert set(by_op) | set(by_module) == set(INT16_PARTS)
    ops: list[Any] = []
    modules: list[str] = []
    for part in parts:
        part = part.strip()
        if not part or part == "auto":  # measured at calibration (quantize_mixed)
            continue
        for name in INT16_PRESETS.get(part, (part,)):
            if name in by_op:
                ops += by_op[name]
            elif name in by_module:
                modules += by_module[name]
            elif not name.replace(".", "").replace("*", "").replace("_", "").isalnum():
                raise QuantizeConfigError(
                    f"int16 part {name!r} is neither a part ({', '.join(INT16_PARTS)}), a preset "
                    f"({', '.join(INT16_PRESETS)}) nor a module name (e.g. model.layers.0.mlp or *.mlp.down_proj)")
            else:  # as written, or under the module circleops wraps (CausalLMLogits.model)
                modules += [name] if name.startswith("*") else [name, "*." + name]
    return ops, modules


def quantize(module: torch.nn.Module, example_args: Sequence[Any], quantizer: Any,
             samples: Sequence[Sequence[Any]], *, exported: Any = None, progress: bool = False,
             export_fn: Callable[[torch.nn.Module, tuple], Any] | None = None) -> tuple[torch.fx.GraphModule, Any]:
    """(converted module, its ExportedProgram). ``exported``: an ExportedProgram of ``module``
    already (e.g. exported inside the adapters' patches and pattern-fused); ``export_fn``
    re-exports the converted module (default: torch.export.export, strict=False)."""
    pt2e, _ = torchao_pt2e()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from circleops.quantize.blocked_fold import blocked_folding

    example_args = tuple(example_args)
    ep = exported if exported is not None else torch.export.export(module, example_args, strict=False)
    prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for args in _progress(samples, progress):
            prepared(*args)
    with blocked_folding():  # each large weight's integers made a block of rows at a time
        converted = convert_pt2e(prepared)
    if _has_mode_ops(converted):  # torchao's rewrite traces its patterns each call: 2-4 s of CPU per graph
        pt2e.move_exported_model_to_eval(converted)
    export_fn = export_fn or (lambda m, a: torch.export.export(m, a, strict=False))
    return converted, export_fn(converted, example_args)


def _has_mode_ops(module: torch.fx.GraphModule) -> bool:
    """Whether the graph holds an op whose train and eval forms differ (dropout, batch norm):
    the only ops torchao's move_exported_model_to_eval rewrites."""
    return any(n.op == "call_function" and ("dropout" in str(n.target) or "batch_norm" in str(n.target))
               for n in module.graph.nodes)


def quantize_mixed(module: torch.nn.Module, example_args: Sequence[Any], make_quantizer: Callable[..., Any],
                   samples: Sequence[Sequence[Any]], *, exported: Any = None, progress: bool = False,
                   min_db: float | None = None, budget: float | None = None) -> tuple[Any, Any, Any]:
    """Mixed precision chosen by measurement: calibrate with ``make_quantizer()`` (uint8),
    score every activation's uint8 rounding (circleops.quantize.sensitivity), then prepare
    and calibrate again with ``make_quantizer(node_names)`` giving the chosen ops int16.
    (converted module, its ExportedProgram, the MixedReport)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from circleops.quantize.recipe import AUTO_BUDGET, AUTO_MIN_DB
    from circleops.quantize.sensitivity import annotated_ops, choose_int16, tensor_sqnr

    example_args = tuple(example_args)
    ep = exported if exported is not None else torch.export.export(module, example_args, strict=False)
    prepared = prepare_pt2e(ep.module(), make_quantizer())
    with torch.no_grad():
        for args in _progress(samples, progress):
            prepared(*args)
    scores = tensor_sqnr(prepared, samples[:2])
    known = {n.name for n in prepared.graph.nodes if "quantization_annotation" in n.meta}
    report = choose_int16(scores, annotated_ops(prepared), min_db=AUTO_MIN_DB if min_db is None else min_db,
                          budget=AUTO_BUDGET if budget is None else budget, known=known)
    del prepared
    converted, qep = quantize(module, example_args, make_quantizer(report.int16_ops), samples, exported=ep,
                              progress=progress)
    return converted, qep, report


def _progress(samples: Sequence[Any], show: bool) -> Iterable[Any]:
    if not show:
        return samples
    from tqdm import tqdm

    return tqdm(samples, desc="calibrate", unit="sample", leave=False)


def calibration_samples(example_args: Sequence[Any], n: int, *, data: str | os.PathLike | None = None,
                        tokenizer: Any = None, vocab_size: int | None = None, seed: int = 0) -> list[tuple]:
    """``n`` calibration inputs shaped like ``example_args``.

    * ``data``: a ``.pt`` file (loaded with weights_only=True) of a tensor [n, ...] (one
      sample per row), a list of tensors, or a list of tuples of tensors.
    * integer token ids [B, S] (an LLM): windows of S tokens of the shipped calibration text
      (tokenized with ``tokenizer``; without one, seeded ids below ``vocab_size``).
    * float inputs: the example input first, then the example plus seeded Gaussian noise
      (half the input's standard deviation).
    """
    if n < 1:
        raise CalibrationError(f"calibrate needs at least 1 sample, got {n}")
    example_args = tuple(example_args)
    if data is not None:
        return _checked_ids(_from_file(data, example_args, n), example_args, vocab_size, data)
    gen = torch.Generator().manual_seed(seed)
    samples: list[tuple] = []
    token_windows = None
    for i in range(n):
        args = []
        for a in example_args:
            if not isinstance(a, torch.Tensor):
                args.append(a)
            elif a.is_floating_point():
                noise = torch.randn(a.shape, generator=gen, dtype=torch.float32).to(a.dtype)
                args.append(a if i == 0 else a + noise * 0.5 * (a.float().std().item() if a.numel() > 1 else 1.0))
            elif a.dtype in (torch.int64, torch.int32) and a.dim() == 2:
                if token_windows is None:
                    token_windows = _token_windows(a.shape[1], n * a.shape[0], tokenizer, vocab_size, gen)
                rows = token_windows[i * a.shape[0]:(i + 1) * a.shape[0]]
                args.append(torch.stack(rows).to(a.dtype))
            else:
                args.append(a)
        samples.append(tuple(args))
    return samples


def _token_windows(length: int, count: int, tokenizer: Any, vocab_size: int | None,
                   gen: torch.Generator) -> list[torch.Tensor]:
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(CALIBRATION_TEXT.read_text())["input_ids"], dtype=torch.int64).reshape(-1)
        if ids.numel() < length:
            ids = ids.repeat(length // max(ids.numel(), 1) + 1)
        step = max(1, (ids.numel() - length) // max(count - 1, 1))
        return [ids[min(k * step, ids.numel() - length):][:length] for k in range(count)]
    if not vocab_size:
        raise CalibrationError("calibrating an LLM needs its tokenizer (for the calibration text) or its vocab size")
    return [torch.randint(0, vocab_size, (length,), generator=gen) for _ in range(count)]


def _checked_ids(items: list[tuple], example_args: tuple, vocab_size: int | None, path: Any) -> list[tuple]:
    """A calibration file's samples, their integer inputs (token ids) checked to be integers in
    [0, vocab_size): an id past the embedding table would index outside it, deep inside calibration."""
    for k, item in enumerate(items):
        for j, (t, ref) in enumerate(zip(item, example_args)):
            if not (isinstance(t, torch.Tensor) and isinstance(ref, torch.Tensor)) or ref.is_floating_point():
                continue
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise CalibrationError(f"calibration sample {k} in {path}: input {j} is {t.dtype}, the model takes "
                                       f"{ref.dtype} token ids; save integer tensors")
            if vocab_size and t.numel():
                lo, hi = int(t.min()), int(t.max())  # the extremes named, not a million ids walked
                check_token_ids([v for v in (lo, hi) if not 0 <= v < vocab_size], vocab_size,
                                f"calibration sample {k} in {path}", error=CalibrationError,
                                fix="Tokenize the calibration text with the model's tokenizer.")
    return items


def _from_file(path: str | os.PathLike, example_args: tuple, n: int) -> list[tuple]:
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist; give a .pt file of input tensors")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - a pickle that is not plain tensors
        raise CalibrationError(f"cannot load {path} with weights_only=True ({type(err).__name__}: {err}); "
                               "save a tensor or a list of tensors with torch.save") from None
    if isinstance(data, torch.Tensor):
        items = [(row.unsqueeze(0),) for row in data] if len(example_args) == 1 and data.dim() == \
            example_args[0].dim() and data.shape[1:] == example_args[0].shape[1:] else [(data,)]
    elif isinstance(data, (list, tuple)):
        items = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in data]
    else:
        raise CalibrationError(f"{path} holds a {type(data).__name__}; expected a tensor or a list of tensors")
    for k, item in enumerate(items):
        shapes = [tuple(t.shape) for t in item if isinstance(t, torch.Tensor)]
        want = [tuple(t.shape) for t in example_args if isinstance(t, torch.Tensor)]
        if shapes != want:
            raise CalibrationError(f"calibration sample {k} in {path} has shapes {shapes}, the model's inputs are "
                                   f"{want}: the file was converted for that shape, give samples of it")
    return items[:n]
