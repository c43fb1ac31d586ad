"""The integer recipe applied to an LLM's weights before PT2E (circleops.quantize.recipe):
the Hadamard rotation, the measured int8 linears, then GPTQ or per-group rounding; each
step in the weights until the caller's ExitStack closes (convert, check --quantize)."""
from __future__ import annotations

import contextlib
from typing import Any

from circleops.errors import TargetError
from circleops.quantize.recipe import IntegerRecipe


def prepare_llm(model: Any, example_args: tuple, recipe: IntegerRecipe, restore: contextlib.ExitStack,
                data_and_tokenizer: tuple, tracker: Any) -> None:
    """Rotation, then GPTQ, of an LLM's weights (in place until ``restore`` closes), as the
    recipe asks; each step's summary goes to ``recipe.lines``. ``tracker``: circleops.pipeline.stages's
    Tracker (its ``stage`` times each step, its ``progress.bar`` shows GPTQ's progress). The
    per-group rounding stays registered for the integer lowering until ``restore`` closes."""
    from circleops.quantize import pt2e
    from circleops.quantize.gptq import eligible_linears, gptq_applied
    from circleops.quantize.rotate import rotated

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
    head = model.get_output_embeddings() if is_llm else None
    bits = {name: 8 if lin is head else recipe.weight_bits for name, lin in eligible_linears(model).items()}
    grouped = None
    samples = None
    int8: list[str] = []
    how = ""
    if recipe.int8_weights == "auto" and recipe.group_size:
        from circleops.quantize.grouped import INT8_BUDGET, INT8_TARGET, choose_int8, linear_sensitivity

        with tracker.stage("sensitivity", enter=False):
            samples = pt2e.calibration_samples(example_args, recipe.calibrate, data=data, tokenizer=tokenizer,
                                               vocab_size=getattr(config, "vocab_size", None))
            linears = eligible_linears(model)
            names = [n for n, b in bits.items() if b == 4 and linears[n].weight.shape[1] % recipe.group_size == 0]
            noise = linear_sensitivity(model, samples[:2], names, recipe.group_size)
            int8 = choose_int8(noise, {n: linears[n].weight.numel() for n in names})
            how = (f"measured: each linear's int4 rounding alone in the logits over {min(2, len(samples))} windows, "
                   f"the worst until {INT8_TARGET:.0%} of the error is left, within {INT8_BUDGET:.0%} of the weights")
    if recipe.gptq:
        with tracker.stage("gptq", enter=False):
            samples = samples or pt2e.calibration_samples(example_args, recipe.calibrate, data=data,
                                                          tokenizer=tokenizer,
                                                          vocab_size=getattr(config, "vocab_size", None))
            report = restore.enter_context(gptq_applied(model, samples, bits, group=recipe.group_size, int8=int8,
                                                        progress=getattr(tracker.progress, "bar", None) is not None))
        recipe.lines.append(report.summary_line())
        grouped = report.grouped
    elif recipe.group_size:
        from circleops.quantize.grouped import rtn_applied

        grouped = restore.enter_context(rtn_applied(model, bits, recipe.group_size, int8=int8))
    if grouped is not None:
        grouped.sensitivity = how
    if grouped is not None:
        from circleops.quantize.grouped import written_as_blockwise

        recipe.lines.append(grouped.summary_line())
        restore.enter_context(written_as_blockwise(grouped.weights))
