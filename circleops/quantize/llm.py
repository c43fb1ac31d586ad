"""The integer recipe applied to an LLM's weights before PT2E (circleops.quantize.recipe):
the Hadamard rotation, the measured int8 linears, then GPTQ or per-group rounding; each
step in the weights until the caller's ExitStack closes (convert, check --quantize). And
the file's measured score (:func:`probe` before, :func:`score` after): convert prints it,
and says what to add when the file is not usable."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circleops.errors import TargetError
from circleops.quantize.recipe import IntegerRecipe


def prepare_llm(model: Any, example_args: tuple, recipe: IntegerRecipe, restore: contextlib.ExitStack,
                data_and_tokenizer: tuple, tracker: Any) -> None:
    """Rotation, then GPTQ, of an LLM's weights (in place until ``restore`` closes), as the
    recipe asks; each step's summary goes to ``recipe.lines``. ``tracker``: circleops.pipeline.stages's
    Tracker (its ``stage`` times each step, its ``progress.bar`` shows GPTQ's progress). The
    per-group rounding stays registered for the integer lowering until ``restore`` closes."""
    from circleops.quantize.gptq import eligible_linears, gptq_applied
    from circleops.quantize.rotate import rotated
    from circleops.system.memory import trim_heap

    data, tokenizer = data_and_tokenizer
    config = getattr(model, "config", None)
    is_llm = getattr(config, "vocab_size", None) is not None and callable(getattr(model, "get_output_embeddings", None))
    if recipe.rotate != "off" and is_llm:
        with tracker.stage("rotate", enter=False):
            report = restore.enter_context(rotated(model, tokenizer))
        if recipe.rotate == "on" and not report.layers:
            raise TargetError(f"rotate='on': {report.summary_line()}")
        recipe.lines.append(report.summary_line())
        recipe.rotation = report.matrix if report.layers else None
        recipe.rotated = report if report.layers else None
        restore.callback(setattr, recipe, "rotated", None)  # before the rotation's own exit
        trim_heap()  # the rotation's freed float64 temporaries, before the rounding's pile up beside them
    head = model.get_output_embeddings() if is_llm else None
    bits = {name: 8 if lin is head else recipe.weight_bits for name, lin in eligible_linears(model).items()}
    grouped = None
    int8: dict[str, tuple] = {}
    if recipe.int8_weights == "auto" and recipe.group_size:
        with tracker.stage("sensitivity", enter=False):
            int8 = _int8_linears(model, bits, recipe, gptq_samples(model, example_args, recipe, data, tokenizer))
    if recipe.gptq:
        with tracker.stage("gptq", enter=False):
            report = restore.enter_context(gptq_applied(
                model, gptq_samples(model, example_args, recipe, data, tokenizer), bits, group=recipe.group_size,
                act_order=recipe.act_order, clip_search=recipe.clip_search, refine=recipe.refine,
                progress=getattr(tracker.progress, "bar", None) is not None))
        recipe.lines.append(report.summary_line())
        grouped = report.grouped
    elif recipe.group_size:
        from circleops.quantize.grouped import rtn_applied

        grouped = restore.enter_context(rtn_applied(model, bits, recipe.group_size))
    if grouped is not None and recipe.int8_weights == "auto":
        from circleops.quantize.grouped import INT8_SHARE, INT8_TARGET, int8_kept

        restore.enter_context(int8_kept(model, grouped, int8))
        grouped.sensitivity = (f"measured: each linear's int4 rounding alone in the logits over 2 calibration "
                               f"windows, the worst until {INT8_TARGET:.0%} of the error is left, within "
                               f"{INT8_SHARE:.0%} of the 4-bit linears' weights")
    if grouped is not None:
        from circleops.quantize.grouped import written_as_blockwise

        recipe.lines.append(grouped.summary_line())
        restore.enter_context(written_as_blockwise(grouped.weights))


def _int8_linears(model: Any, bits: dict[str, int], recipe: IntegerRecipe, samples: list[tuple]) -> dict[str, tuple]:
    """The linears kept at int8 (name -> the int8 rounding of its weight, applied after the
    4-bit rounding): each 4-bit linear's own int4 rounding measured alone in the logits of
    two calibration windows, the worst first (grouped.choose_int8) within INT8_SHARE of the
    weights. Measured against choosing by what int8 gains after the rounding (SmolLM2 16a4w,
    weights only, 24 hold-out windows: 15.77 dB and 79.4 % top-1 against 15.38 dB and 78.8 %,
    bench/results/36-npu-16a4w.yaml), at a fraction of its CPU (no rerun of the rounded model)."""
    from circleops.quantize.grouped import INT8_SHARE, INT8_TARGET, choose_int8, eligible_linears, \
        int8_rounding, linear_sensitivity

    linears = eligible_linears(model)
    names = [n for n, b in bits.items() if b == 4 and linears[n].weight.shape[1] % recipe.group_size == 0]
    noise = linear_sensitivity(model, samples[:2], names, recipe.group_size)
    chosen = choose_int8(noise, {n: linears[n].weight.numel() for n in names}, target=INT8_TARGET, budget=INT8_SHARE)
    return {n: int8_rounding(linears[n].weight) for n in chosen}


# GPTQ's Hessians of an LLM: the calibration text in windows of this many tokens (all of it,
# 513 tokens, where the example's length would give calibrate x S: 256 for 8 windows of 32;
# SmolLM2 16a4w act order, weights only, 24 hold-out windows: 13.8 dB and 75.3 % top-1 against 13.3 dB and 71.6 %,
# bench/results/36-npu-16a4w.yaml). Hessians of down_proj (1536 inputs) need the tokens.
GPTQ_WINDOW = 128
GPTQ_TOKENS = 512


def gptq_samples(model: Any, example_args: tuple, recipe: IntegerRecipe, data: Any, tokenizer: Any) -> list[tuple]:
    """GPTQ's calibration inputs: the user's (``data``), or for an LLM taking [1, S] token ids
    the calibration text in windows of GPTQ_WINDOW tokens (GPTQ_TOKENS in all, within the
    model's context), else the PT2E samples of the example's shape."""
    from circleops.quantize import pt2e

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    ids = example_args[0] if len(example_args) == 1 else None
    if data is None and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 \
            and not ids.is_floating_point() and vocab is not None:
        length = min(GPTQ_WINDOW, getattr(config, "max_position_embeddings", None) or GPTQ_WINDOW)
        if length > ids.shape[1]:
            return pt2e.calibration_samples((torch.zeros(1, length, dtype=ids.dtype),), GPTQ_TOKENS // length,
                                            tokenizer=tokenizer, vocab_size=vocab)
    return pt2e.calibration_samples(example_args, recipe.calibrate, data=data, tokenizer=tokenizer,
                                    vocab_size=vocab)


# What an integer LLM file must score on the hold-out text to be called usable (issue 22's
# goal for the NPU recipes: bench/results/35-npu-defaults.yaml measures the recipes against it)
USABLE_DB = 15.0
USABLE_AGREEMENT = 0.875  # 28 of 32 positions
HOLDOUT_TEXT = Path(__file__).with_name("perplexity.txt")  # never calibrated on (calibration.txt is)


@dataclass
class Probe:
    """fp32 logits of the hold-out text, taken before the recipe changes the weights."""

    ids: torch.Tensor  # [1, S]: the first S tokens of HOLDOUT_TEXT, S the example's length
    logits: torch.Tensor  # [S, vocab] float64


def probe(model: Any, example_args: tuple, tokenizer: Any = None) -> Probe | None:
    """The fp32 model's logits on the hold-out text's first S tokens (S the example's sequence
    length), for an LLM taking one [1, S] tensor of token ids; None for any other model."""
    from circleops.quantize.recipe import is_causal_lm

    if not is_causal_lm(model) or len(example_args) != 1 or not isinstance(example_args[0], torch.Tensor) \
            or example_args[0].dim() != 2 or example_args[0].shape[0] != 1 or example_args[0].is_floating_point():
        return None
    length, vocab = int(example_args[0].shape[1]), int(model.config.vocab_size)
    text = HOLDOUT_TEXT.read_text()
    ids = list(tokenizer(text)["input_ids"]) if tokenizer is not None else [b % vocab for b in text.encode()]
    ids = (ids * (length // max(len(ids), 1) + 1))[:length]
    ids_t = torch.tensor([ids], dtype=example_args[0].dtype)
    with torch.no_grad():
        out = model(ids_t)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return Probe(ids_t, logits[0].detach().to(torch.float64))


def score(p: Probe, converted: Any) -> tuple[float, int, int]:
    """(logits SQNR in dB, positions whose top-1 equals fp32's, positions) of the converted
    (fake-quantized) module on the probe's tokens: what the file computes, within its rounding."""
    with torch.no_grad():
        out = converted(p.ids)
    got = (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out)
    got = got.reshape(p.logits.shape).detach().to(torch.float64)
    noise = float((got - p.logits).pow(2).sum())
    db = math.inf if noise == 0 else 10 * math.log10(float(p.logits.pow(2).sum()) / noise)
    return db, int((got.argmax(-1) == p.logits.argmax(-1)).sum()), int(p.logits.shape[0])


def score_line(recipe: IntegerRecipe, target: str, db: float, agree: int, n: int) -> tuple[str, str | None]:
    """The summary line of the file's measured score, and a warning naming what to add when
    it is below USABLE_DB or USABLE_AGREEMENT (None when it is not)."""
    line = (f"measured on {n} tokens of a hold-out text (fp32 vs the fake-quantized module the file matches): "
            f"logits SQNR {db:.1f} dB, top-1 agreement {agree}/{n}")
    if db >= USABLE_DB and agree >= USABLE_AGREEMENT * n:
        return line, None
    from circleops.targets import profile

    if recipe.scheme == "uint8" and not recipe.int16:
        fix = ("add --int16 auto (measured mixed precision)" if "INT16" in profile(target).quantized_dtypes else
               f"{target} loads no int16 tensor, so --int16 auto cannot help here: for an NPU write --target "
               "circle (--int16 auto is its default for an LLM); for onert's CPU use --quantize q4_0 or w8")
    elif recipe.weight_bits == 4 and not (recipe.gptq and recipe.int8_weights):
        fix = "add " + " ".join(f for f, on in (("--gptq", recipe.gptq), ("--int8-weights auto", recipe.int8_weights))
                                if not on) + ", or --weight-bits 8"
    elif recipe.weight_bits == 4:
        fix = "use --weight-bits 8 (int16 activations with int8 weights)"
    else:
        fix = "see docs/integer-llm.md for the recipes measured on SmolLM2"
    return line, (f"this {recipe.scheme} file scores {db:.1f} dB and {agree}/{n} top-1 against fp32 on a hold-out "
                  f"text (usable: >= {USABLE_DB:g} dB, >= {USABLE_AGREEMENT:.0%}): {fix}")
