"""``circleops check MODEL --quantize q4_0``: what GGML weight quantization costs.

The model is converted for target onert with ``quantize`` (as ``convert --quantize`` writes
it) and run by onert (or the reference interpreter); the report gives

* per decoder layer, the max error of its output against the fp32 model (torch);
* how many of fp32's N greedy tokens the quantized file reproduces before the first
  divergence (measured as circleops.tools.precision does: one run over prompt + fp32's tokens);
* the perplexity of fp32 (torch) and of the quantized file on a fixed English text shipped
  with circleops (``perplexity.txt``, ~2.4k SmolLM2 tokens), in non-overlapping windows.

    from circleops.tools.quant_report import quant_check
    report = quant_check(model, tokenizer, quantize="q4_0")
    print(report.table())
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.tools.precision import ReportOptions

PERPLEXITY_TEXT = Path(__file__).parents[1] / "quantize" / "perplexity.txt"  # shipped with the quantizers
DEFAULT_WINDOW = 256


@dataclass
class QuantCheckReport:
    source: str
    format: str
    runtime: str
    prompt: str | None
    prompt_ids: list[int]
    new_tokens: int
    reference_tokens: list[int]
    reference_text: str | None
    layer_max_abs: list[float]
    layer_rel: list[float]  # max abs error / max |fp32 layer output|
    logits_max_abs: float
    agreement: int  # leading greedy tokens equal to fp32's
    generated_text: str | None
    perplexity_fp32: float
    perplexity_quantized: float
    perplexity_tokens: int  # tokens scored (windows x (window - 1))
    window: int
    file_bytes: int
    quantization: list[str] = field(default_factory=list)  # QuantReport.summary_lines()
    timings: dict[str, float] = field(default_factory=dict)
    layer_sqnr_db: list[float] = field(default_factory=list)  # 10·log10(Σ fp32² / Σ error²) per layer
    note: str | None = None  # why the file ran on another runtime than asked by default
    logits_sqnr_db: float | None = None  # over the N positions predicting fp32's greedy tokens
    recipe: dict[str, Any] | None = None  # an integer format's recipe (circleops.quantize.recipe)
    tico: dict[str, Any] | None = None  # TICO's PTQ on the same windows (or why it did not run)
    # the perplexity windows teacher-forced (a hold-out text: never calibrated on): logits SQNR
    # and how many positions' top-1 equals fp32's (each position, not only the leading ones)
    holdout_sqnr_db: float | None = None
    holdout_agreement: int = 0
    holdout_positions: int = 0

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_quantized / self.perplexity_fp32

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps({**asdict(self), "perplexity_ratio": self.perplexity_ratio}, indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def table(self) -> str:
        kind = "activations" if self.recipe is not None else "weights"
        lines = [f"{self.source}: {self.format} {kind}, run by {self.runtime} (file {self.file_bytes / 1e6:.1f} MB)"]
        lines += [f"  {line}" for line in self.quantization]
        if self.note:
            lines.append(f"  note: {self.note}")
        lines.append("")
        lines.append("layer  max abs error  relative (to max |fp32 output|)  SQNR (dB)")
        for k, (a, r) in enumerate(zip(self.layer_max_abs, self.layer_rel)):
            db = self.layer_sqnr_db[k] if k < len(self.layer_sqnr_db) else float("nan")
            lines.append(f"{k:>5}  {a:>13.4g}  {r:>9.3%}  {db:>34.1f}")
        lines.append(f"logits max abs error {self.logits_max_abs:.4g}"
                     + (f", SQNR {self.logits_sqnr_db:.1f} dB over the {self.new_tokens} predicting positions"
                        if self.logits_sqnr_db is not None else ""))
        lines.append(f"greedy tokens equal to fp32's: {self.agreement} of {self.new_tokens}"
                     + (f"  ({self.generated_text!r})" if self.generated_text is not None else ""))
        lines.append(f"perplexity on {self.perplexity_tokens} tokens (windows of {self.window}): fp32 "
                     f"{self.perplexity_fp32:.3f}, {self.format} {self.perplexity_quantized:.3f} "
                     f"({self.perplexity_ratio - 1:+.2%})")
        if self.holdout_sqnr_db is not None:
            lines.append(f"hold-out text (the same windows, teacher-forced): logits SQNR {self.holdout_sqnr_db:.1f} dB, "
                         f"top-1 equal to fp32's at {self.holdout_agreement} of {self.holdout_positions} positions "
                         f"({self.holdout_agreement / max(self.holdout_positions, 1):.1%})")
        if self.tico is not None:
            t = self.tico
            if "error" in t:
                lines.append(f"TICO {t.get('version', '')} PTQ: {t['error']}")
            else:
                lines.append(f"TICO {t['version']} PTQ ({t['config']}; its fake-quantized torch model, the same "
                             f"{t['calibrate']} calibration windows): logits SQNR {t['logits_sqnr_db']:.1f} dB, greedy "
                             f"tokens equal to fp32's {t['agreement']} of {self.new_tokens}, perplexity "
                             f"{t['perplexity']:.3f} ({t['perplexity'] / self.perplexity_fp32 - 1:+.2%})")
        lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()))
        return "\n".join(lines)


def text_ids(tokenizer: Any, vocab: int, text: str | None = None) -> list[int]:
    """The perplexity text as token ids; without a tokenizer its UTF-8 bytes modulo the
    vocabulary (a fixed sequence, so fp32 and the quantized file still score the same ids)."""
    text = PERPLEXITY_TEXT.read_text() if text is None else text
    if tokenizer is not None:
        return list(tokenizer(text).input_ids)
    return [b % vocab for b in text.encode()]


@dataclass
class QuantCheckOptions(ReportOptions):
    """``quant_check``'s options (the prompt, tokens, work_dir and source are
    :class:`circleops.tools.precision.ReportOptions`')."""

    quantize: str = "q4_0"  # a --quantize format
    text: str | None = None  # the perplexity text (default: the shipped PERPLEXITY_TEXT)
    window: int = DEFAULT_WINDOW  # perplexity window in tokens (at most the model's positions)
    max_windows: int | None = None  # score only the first K windows (default: all)
    runtime: str | None = None  # of the quantized file: "onert", "reference", "litert"; None: chosen
    recipe: Any = None  # an integer format's IntegerRecipe, or RecipeOptions (None: all left out)
    calibration_data: str | os.PathLike | None = None  # an integer format's calibration text or ids
    tico: bool = False  # also TICO's PTQ on the same windows


def quant_check(model: Any, tokenizer: Any = None, options: QuantCheckOptions | None = None, *,
                progress: Callable[[str], None] | None = None, **fields: Any) -> QuantCheckReport:
    """The quantization report of ``model`` (a Hugging Face *ForCausalLM, fp32, unchanged).

    ``options``: a :class:`QuantCheckOptions`; its fields may also be given as keywords
    (``quant_check(model, tok, quantize="q8_0", new_tokens=8)``).
    ``runtime``: "onert" or "reference"; None is onert, or the reference interpreter where
    onert cannot run GGML weights on this CPU (circleops.runtime.host; the report says so),
    or where onert cannot run the integer recipe (int16, 4-bit weights, int16 parts).
    ``recipe``: for "uint8" / "int16", a circleops.quantize.recipe.IntegerRecipe (weight
    bits, group size, GPTQ, rotation, int16 parts, calibration windows), applied as convert
    applies it, or the options as given (a RecipeOptions; None: all left out), completed with
    the defaults convert gives an LLM for target circle (resolve_recipe). ``tico``: also TICO's PTQ
    (tico.quantization, default PTQConfig) calibrated on the same windows, scored in torch.
    "litert": the --target tflite file (w8 only), with the fused ops the tflite generation
    graphs write inline inlined here too (TargetProfile.graph_inline_ops: attention, whose
    linears a composite would keep float), so it measures the files generate runs."""
    import numpy as np
    import torch

    from circleops.tools import precision as fp
    from circleops.pipeline import stages as pipeline
    from circleops.pipeline.stages import CausalLMLogits, hf_export_settings

    o = fp.options_with(options or QuantCheckOptions(), fields)
    plan = _plan(o, model)
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    limit = getattr(model.config, "max_position_embeddings", None) or o.window
    o = dataclasses.replace(o, window=max(2, min(o.window, limit)),
                            prompt=o.prompt if o.prompt is not None else fp.DEFAULT_PROMPT)

    t = time.perf_counter()
    ref = fp.fp32_reference(model, tokenizer, o, say)
    timings["reference"] = time.perf_counter() - t
    chunks = _windows(text_ids(tokenizer, int(model.config.vocab_size), o.text), o.window, o.max_windows)
    logits_module = CausalLMLogits(ref.model).eval()
    t, holdout = time.perf_counter(), _Holdout()
    with hf_export_settings(ref.model), torch.no_grad():  # the model as given (before w8's smoothing)
        fp32_nll = [_nll(holdout.keep(logits_module(torch.tensor([c]))[0].numpy()), c) for c in chunks]
    fp32_seconds = time.perf_counter() - t

    with contextlib.ExitStack() as restore, fp.WorkDirectory(o.work_dir) as directory:
        job = _Job(o, plan, ref, tokenizer, Path(directory), say, timings,
                   pipeline.Options(plan.target, quantize=o.quantize, functionalize=False))
        weights = _prepare(job, restore)
        layers = _layer_errors(job, weights)
        t = time.perf_counter()
        say(f"perplexity: fp32 (torch) and {o.quantize} ({plan.runtime}), windows of {o.window}")
        run = _perplexity_run(job, logits_module, chunks[0], weights)
        q_nll = [_nll(holdout.compare(k, run([np.array([c], dtype=np.int64)])[0][0]), c) for k, c in enumerate(chunks)]
        timings["perplexity"] = time.perf_counter() - t + fp32_seconds
    tico_result = None
    if o.tico:  # after the recipe's weights are restored: TICO quantizes the model as given
        t = time.perf_counter()
        say("TICO PTQ (default PTQConfig) on the same calibration windows, scored in torch")
        tico_result = tico_ptq(ref.model, tokenizer, ref.seq, chunks, start=len(ref.ids), tokens=ref.tokens,
                               calibrate=plan.recipe.calibrate, calibration_data=o.calibration_data)
        timings["tico"] = time.perf_counter() - t

    return QuantCheckReport(
        source=o.source or type(model).__name__, format=o.quantize, runtime=plan.runtime, note=plan.note,
        prompt=ref.prompt, prompt_ids=list(ref.ids), new_tokens=o.new_tokens, reference_tokens=ref.tokens,
        reference_text=fp.decode_text(tokenizer, ref.tokens), layer_max_abs=layers.errors, layer_rel=layers.rel,
        logits_max_abs=layers.logits_error, agreement=layers.agreement,
        generated_text=fp.decode_text(tokenizer, layers.predicted[:layers.agreement + 1]),
        perplexity_fp32=math.exp(float(np.mean(fp32_nll))), perplexity_quantized=math.exp(float(np.mean(q_nll))),
        perplexity_tokens=len(chunks) * (o.window - 1), window=o.window, file_bytes=layers.file_bytes,
        quantization=layers.summary, timings=timings, layer_sqnr_db=layers.sqnr, logits_sqnr_db=layers.logits_sqnr,
        recipe=plan.recipe.to_dict() if plan.integer else None, tico=tico_result, holdout_sqnr_db=holdout.sqnr_db(),
        holdout_agreement=holdout.agree, holdout_positions=holdout.positions)


@dataclass
class _Plan:
    """How the quantized files are made and run: an integer (PT2E) format or weights only,
    its recipe, the target they are written for, the runtime and why it was chosen."""

    integer: bool
    recipe: Any
    target: str
    runtime: str
    note: str | None


def _plan(o: QuantCheckOptions, model: Any) -> _Plan:
    """The format's target and runtime, its options checked as convert checks them (an
    integer recipe's options left out completed as convert completes them for ``model``)."""
    from circleops.errors import CircleOpsError
    from circleops.pipeline.validate import validate_quantize
    from circleops.quantize import formats
    from circleops.runtime import choose_runtime

    quantize, runtime, recipe = o.quantize, o.runtime, o.recipe
    # an integer graph (PT2E): onert runs uint8 files written for it; int16 (and any
    # file for NPU compilers) runs in the reference interpreter's integer kernels
    integer = formats.get(quantize) is not None and formats.get(quantize).kind == formats.INTEGER
    if integer:
        from circleops.quantize.recipe import IntegerRecipe, RecipeOptions, check_recipe, resolve_recipe

        if not isinstance(recipe, IntegerRecipe):  # the options as given, the LLM defaults for the rest
            recipe = resolve_recipe(quantize, "onert" if runtime == "onert" else "circle", model,
                                    recipe if recipe is not None else RecipeOptions())
        recipe.scheme = quantize
        if runtime is None and (quantize == "int16" or recipe.weight_bits == 4 or recipe.int16):
            runtime = "reference"  # onert loads no int16 / int4 graph (circleops.pipeline.validate)
        check_recipe(quantize, "onert" if runtime in (None, "onert") else "circle", recipe.weight_bits, recipe.gptq,
                     recipe.rotate, recipe.group_size)
    elif recipe is not None or o.tico:
        raise CircleOpsError(f"the integer recipe options and --tico apply to --quantize uint8 / int16, not {quantize}")
    if runtime is None and not integer and formats.get(quantize) is not None \
            and formats.get(quantize).file_formats == frozenset({"tflite"}):
        runtime = "litert"  # int4: only LiteRT runs its files (a tflite format)
    target = "onert" if not integer or runtime in (None, "onert") else "circle"
    if runtime == "litert" and not integer:
        target = "tflite"  # LiteRT reads the tflite target's files (w8: its dynamic-range form)
    validate_quantize(quantize, target, recipe.int16 if integer else ())
    if runtime is not None and runtime not in formats.get(quantize).runtimes:
        raise CircleOpsError(f"runtime {runtime!r}: {quantize} files run in "
                             f"{' or '.join(sorted(formats.get(quantize).runtimes))}")
    runtime, note = choose_runtime(runtime, target, quantize, "run")
    if o.new_tokens < 1:
        raise CircleOpsError(f"--new-tokens must be at least 1, got {o.new_tokens}.")
    return _Plan(integer, recipe, target, runtime, note)


def _windows(all_ids: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    """The perplexity text's non-overlapping windows (the first ``max_windows``)."""
    from circleops.errors import CircleOpsError

    count = len(all_ids) // window if max_windows is None else min(max_windows, len(all_ids) // window)
    if count < 1:
        raise CircleOpsError(f"the perplexity text has {len(all_ids)} tokens, fewer than one window of {window}.")
    return [all_ids[k * window:(k + 1) * window] for k in range(count)]


@dataclass
class _Job:
    """One report's quantized files: what they are written from and where."""

    o: QuantCheckOptions
    plan: _Plan
    ref: Any  # circleops.tools.precision.Reference
    tokenizer: Any
    directory: Path
    say: Callable[[str], None]
    timings: dict[str, float]
    opts: Any  # the files' circleops.pipeline.stages.Options

    def write(self, module: Any, example: Any, stem: str, weights: Any) -> tuple[Path, list[str]]:
        """``module`` exported on ``example`` and written as convert writes it; (its path, the
        quantization summary lines)."""
        import torch

        from circleops.pipeline.stages import export, hf_export_settings

        opts, reference = self.opts, self.ref.model
        calibration = (self.plan.recipe, self.o.calibration_data, _head_names(module, reference))
        with hf_export_settings(reference), torch.no_grad():
            ep = export(module, (example,), adapters=True, warn_list=[])
        path = self.directory / f"{stem}_{self.o.quantize}.{opts.profile.format}"
        summary = _write(ep, path, opts, weights, Example((example,), self.tokenizer, reference.config), calibration)
        return path, summary


def _prepare(job: _Job, restore: contextlib.ExitStack) -> Any:
    """As convert does: w8's SmoothQuant folded into the weights, q4_0's input importances; an
    integer recipe's rotation and GPTQ / per-group rounding, in the weights until ``restore``
    closes. The weight inputs of the files."""
    from circleops.pipeline import stages as pipeline
    from circleops.pipeline.stages import hf_export_settings

    reference, recipe = job.ref.model, job.plan.recipe
    tracker = pipeline.Tracker(timings=job.timings)
    weights = pipeline.prepare_weights(reference, job.opts, restore, tokenizer=job.tokenizer, tracker=tracker)
    if job.plan.integer:
        from circleops.quantize.llm import prepare_llm

        job.say(f"integer recipe: {job.o.quantize}, {recipe.weight_label}" + (", GPTQ" if recipe.gptq else "")
                + f", rotate {recipe.rotate}")
        with hf_export_settings(reference):
            prepare_llm(reference, (job.ref.seq,), recipe, restore, (job.o.calibration_data, job.tokenizer), tracker)
    return weights


@dataclass
class _LayerErrors:
    """The layers file against fp32: per layer and on the logits."""

    errors: list[float]
    rel: list[float]
    sqnr: list[float]
    logits_error: float
    logits_sqnr: float
    predicted: list[int]
    agreement: int
    summary: list[str]  # the file's quantization summary lines
    file_bytes: int


def _layer_errors(job: _Job, weights: Any) -> _LayerErrors:
    """The quantized file of the model's logits and decoder layer outputs, run on the
    reference's sequence and compared with fp32's."""
    import numpy as np

    from circleops.numerics import LayerOutputs

    t = time.perf_counter()
    ref, plan = job.ref, job.plan
    job.say(f"convert ({job.o.quantize}) and run the layer outputs")
    path, summary = job.write(LayerOutputs(ref.model).eval(), ref.seq, "layers", weights)
    got = _run(plan.runtime, path, [ref.seq.numpy()])
    job.timings["layers"] = time.perf_counter() - t
    errors, rel, sqnr = [], [], []
    rotation = plan.recipe.rotation.double().numpy() if plan.integer and plan.recipe.rotation is not None else None
    for g, w in zip(got[1:], ref.want[1:]):
        if rotation is not None:  # the rotated model's residual stream is h · Q: compare h
            g = g.astype(np.float64) @ rotation.T
        diff = g.astype(np.float64) - w.double().numpy()
        e = float(np.abs(diff).max())
        errors.append(e)
        noise = float(np.sum(diff ** 2))
        sqnr.append(float("inf") if noise == 0 else 10 * math.log10(float(w.double().pow(2).sum()) / noise))
        scale = float(w.abs().max())
        rel.append(e / scale if scale > 0 else e)
    logits, want = got[0][0], ref.want[0][0].numpy()
    start, n = len(ref.ids) - 1, len(ref.tokens)
    predicted, agreement = ref.agreement(logits)
    return _LayerErrors(errors, rel, sqnr, float(np.abs(logits - want).max()),
                        sqnr_db(want[start: start + n], logits[start: start + n]), predicted, agreement, summary,
                        path.stat().st_size)


class _Holdout:
    """fp32's logits of each perplexity window, kept on disk (SmolLM2: 50 MB a window) until
    the quantized file's are compared with them: the hold-out SQNR and top-1 agreement."""

    def __init__(self) -> None:
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="circleops-holdout-")
        self.signal = self.noise = 0.0
        self.agree = self.positions = self.kept = 0

    def keep(self, logits: Any) -> Any:
        import numpy as np

        np.save(Path(self._dir.name) / f"{self.kept}.npy", np.asarray(logits, np.float32))
        self.kept += 1
        return logits

    def compare(self, k: int, got: Any) -> Any:
        import numpy as np

        ref = np.load(Path(self._dir.name) / f"{k}.npy", mmap_mode="r").astype(np.float64)
        g = np.asarray(got, np.float64).reshape(ref.shape)
        self.signal += float(np.sum(ref ** 2))
        self.noise += float(np.sum((ref - g) ** 2))
        self.agree += int(np.sum(ref.argmax(-1) == g.argmax(-1)))
        self.positions += ref.shape[0]
        return got

    def sqnr_db(self) -> float | None:
        """The SQNR over every compared window (None: none compared); the kept logits deleted."""
        self._dir.cleanup()
        if not self.signal:
            return None
        return float("inf") if self.noise == 0 else float(10 * math.log10(self.signal / self.noise))


def sqnr_db(ref: Any, got: Any) -> float:
    """10·log10(Σ ref² / Σ (ref - got)²) in dB (inf when equal)."""
    import numpy as np

    ref = np.asarray(ref, np.float64)
    noise = float(np.sum((ref - np.asarray(got, np.float64)) ** 2))
    return float("inf") if noise == 0 else float(10 * np.log10(float(np.sum(ref ** 2)) / noise))


def _head_names(wrapper: Any, model: Any) -> tuple[str, ...]:
    """The output head's module name inside ``wrapper`` (4-bit recipes keep it int8)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    return tuple(name for name, m in wrapper.named_modules() if head is not None and m is head)[:1]


def tico_ptq(model: Any, tokenizer: Any, seq: Any, chunks: Sequence[Sequence[int]], *, start: int,
             tokens: Sequence[int], calibrate: int, calibration_data: Any = None) -> dict[str, Any]:
    """TICO's post-training quantization (tico.quantization.prepare / convert with its default
    PTQConfig, as its examples do) of a copy of ``model``, calibrated on the calibration
    windows circleops uses, scored in torch (its fake-quantized model: TICO's own numbers,
    before its export): logits SQNR and greedy agreement on ``seq``, perplexity on
    ``chunks``. A failure is recorded (the stage and the error), not raised."""
    import copy
    import importlib.metadata

    import numpy as np
    import torch

    from circleops.quantize.pt2e import calibration_samples

    result: dict[str, Any] = {"config": "default PTQConfig(): uint8 activations, uint8 per-channel weights"}
    stage = "import"
    try:
        result["version"] = importlib.metadata.version("tico")
        from tico.quantization import convert, prepare
        from tico.quantization.config.ptq import PTQConfig

        stage = "prepare"
        m = copy.deepcopy(model).eval()
        m.config.use_cache = False
        m.config._attn_implementation = "eager"
        # TICO's Llama wrappers build their mask and RoPE tables for max_position_embeddings
        m.config.max_position_embeddings = max(seq.shape[1], max(len(c) for c in chunks))
        q = prepare(m, PTQConfig())
        stage = "calibrate"
        samples = calibration_samples((seq,), calibrate, data=calibration_data, tokenizer=tokenizer,
                                      vocab_size=int(model.config.vocab_size))
        with torch.no_grad():
            for args in samples:
                q(input_ids=args[0], use_cache=False)
            stage = "convert"
            q = convert(q)
            stage = "score"
            n = len(tokens)
            logits = q(input_ids=seq, use_cache=False).logits[0].float().numpy()
            want = model(seq).logits[0].float().numpy()
            got = logits[start - 1: start - 1 + n]
            predicted = got.argmax(-1).tolist()
            result["logits_sqnr_db"] = sqnr_db(want[start - 1: start - 1 + n], got)
            result["agreement"] = next((k for k in range(n) if predicted[k] != tokens[k]), n)
            nll = [_nll(q(input_ids=torch.tensor([c]), use_cache=False).logits[0].float().numpy(), c) for c in chunks]
        result["perplexity"] = float(np.exp(np.mean(nll)))
        result["calibrate"] = len(samples)
    except Exception as err:  # noqa: BLE001 - TICO failing on a model is a finding of the report
        result["error"] = f"fails at {stage}: {type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
    return result


@dataclass
class Example:
    """The example input a file is written for, and what PT2E calibrates on."""

    args: tuple
    tokenizer: Any = None
    config: Any = None


def _write(ep: Any, path: Path, opts: Any, weights: Any, example: Example,
           calibration: tuple = (None, None, ())) -> list[str]:
    """The file convert writes for ``ep`` (circleops.pipeline.stages): PT2E calibrated on windows of
    the shipped calibration text (or ``calibration``'s data) for an integer format, with its
    recipe; the quantization summary lines."""
    from circleops.pipeline import stages as pipeline

    from circleops.package.step import graph_inline_ops

    pipeline.inline_fused_ops(ep, graph_inline_ops(opts))  # as the target's generation graphs write them
    lines = None
    if opts.integer_format is not None:
        recipe, data, head = calibration
        count = recipe.calibrate if recipe is not None else 8
        _, ep = pipeline.quantize_program(ep, None, opts, pipeline.Calibration(
            example.args, count, data=data, tokenizer=example.tokenizer, vocab_size=example.config.vocab_size,
            int16=tuple(recipe.int16) if recipe is not None else (), recipe=recipe, head=tuple(head)))
        lines = recipe.summary_lines() if recipe is not None else [
            f"{opts.quantize} activations, {pipeline.integer_weight_dtype(opts.target)} weights, int32 bias "
            f"(PT2E, {count} calibration windows)"]
        if recipe is not None and opts.target == "onert":
            lines[0] = lines[0].replace(recipe.weight_label, "uint8 per-tensor weights (target onert)")
        weights = pipeline.WeightInputs()
    # else the files share ``weights`` (report, blocks, fused linears), as a convert's graphs
    # do: w8's SmoothQuant gives each folded weight its own values back once its blocks exist
    # (circleops.system.snapshot.restore_read), so a second file quantizing afresh read the
    # unsmoothed weights beside the smoothed norms (SmolLM2's w8 perplexity 1.9e6, not 28.7)
    built = pipeline.build({"main": ep}, opts, weights)
    pipeline.write(built.models["main"], path, opts)
    return lines if lines is not None else built.quantization.summary_lines()


def _rows_logits(model: Any) -> Any:
    """An HF CausalLM as a module ``embedding rows [1, S, hidden] -> logits``, the rows scaled
    as the model's embedding scales them: the file of a tied model whose generation graphs take
    the rows the generator reads from the quantized head (circleops.package.split.PartBytes.head_rows)."""
    import torch

    from circleops.adapters.decode import scale_rows

    class RowsLogits(torch.nn.Module):
        def __init__(self, inner: Any):
            super().__init__()
            self.model = inner

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            embeds = scale_rows(self.model.get_input_embeddings(), rows)
            return self.model(inputs_embeds=embeds, use_cache=False, return_dict=True).logits

    return RowsLogits(model).eval()


def _perplexity_run(job: _Job, logits_module: Any, window: Sequence[int], weights: Any) -> Callable[[list[Any]], list[Any]]:
    """The quantized logits file's run on ``[ids]``, as generation computes them: where the
    generation graphs of the format take the tied table's rows from the quantized head (onert's
    w8, q4_0, q8_0: the table is not stored), the file takes rows too and they are read from
    its head (circleops.runtime.chain.HeadEmbedding), so the perplexity is the directory's;
    else the file takes the ids."""
    import torch

    from circleops.package import split

    model = job.ref.model
    if job.plan.integer or not split.part_bytes(model, job.o.quantize, job.plan.target).head_rows:
        return _session(job.plan.runtime, job.write(logits_module, torch.tensor([window]), "logits", weights)[0])
    from circleops.quantize.weights import QuantReport, source_key
    from circleops.runtime.chain import HeadEmbedding

    fmt = job.opts.weight_format
    weights.report = weights.report or QuantReport(fmt.name, form=fmt.form_for(job.opts.profile.format))
    weights.report.host_tables.add(source_key(model.get_input_embeddings().weight.detach()))
    rows = torch.zeros((1, len(window), int(model.config.hidden_size)), dtype=torch.float32)
    path = job.write(_rows_logits(model), rows, "logits", weights)[0]
    embed, run = HeadEmbedding(path), _session(job.plan.runtime, path)
    return lambda inputs: run([embed(inputs[0])])


def _session(runtime: str, path: Path) -> Callable[[list[Any]], list[Any]]:
    from circleops.runtime import open_session

    # isolated: a crash of onert on the file is reported, not fatal (issue 24)
    return open_session(runtime, str(path), isolated=True).run


def _run(runtime: str, path: Path, inputs: list[Any]) -> list[Any]:
    return _session(runtime, path)(inputs)


def _nll(logits: Any, ids: Sequence[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given the logits at positions [:-1]."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)[:-1]
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean())
