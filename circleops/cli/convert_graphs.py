"""``circleops convert MODEL --graphs LIST -o DIR``: a recipe's graphs instead of one forward
(circleops.recipes: a causal LM's prefill,decode; a vision-language model's
vision,prefill,decode; Whisper's and a text-to-text model's encoder,prefill,decode), written by
the package step; the options are circleops.cli.convert's, built once."""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

# the recipe of each kind: module, class
RECIPES = {"text": ("circleops.recipes.llm", "LLMRecipe"), "vision": ("circleops.recipes.vlm", "VLMRecipe"),
           "speech": ("circleops.recipes.speech", "SpeechRecipe"),
           "text2text": ("circleops.recipes.text2text", "Text2TextRecipe")}


def recipe_kind(model: str | None, options: Any) -> str:
    """text2text for a T5, BART, mBART or Marian directory (or config), speech for --graphs
    naming the encoder or a Whisper directory (whose other --graphs lists its recipe refuses,
    saying which it takes), vision for the vision graph or a VLM, else text."""
    from circleops.package.speech_manifest import speech_model_type
    from circleops.package.text2text_manifest import text2text_model_type
    from circleops.package.vision_manifest import VISION_GRAPH, vlm_model_type

    names = {n.strip() for n in str(options.graphs).split(",")}
    if text2text_model_type(model, options.config) is not None:
        return "text2text"
    if "encoder" in names or (model is not None and speech_model_type(model) is not None):
        return "speech"
    if VISION_GRAPH in names or vlm_model_type(model, options.config) is not None:
        return "vision"
    return "text"


def main(args: argparse.Namespace, options: Any) -> int:
    from circleops.cli.common import finish_graphs, scipy_hidden
    from circleops.errors import OutputError, TargetError
    from circleops.package import step

    module, name = RECIPES[recipe_kind(args.model, options)]
    if args.model is None and options.config is None:
        raise TargetError("no model given: pass MODEL (an HF directory, a .gguf file or smollm2), or --config "
                          "config.json for random weights.")
    if name == "VLMRecipe":
        _check_vlm_sizes(args, options)  # before the recipe's import (torch)
    recipe = getattr(importlib.import_module(module), name)
    recipe.check_options(options, args.model)  # what no model can give is refused before the model loads
    out = Path(args.output)
    if out.suffix.lower() in (".circle", ".tflite"):
        raise OutputError(f"with --graphs, -o names a directory (the graphs, manifest.json and the tokenizer or "
                          f"processor go into it), not a {out.suffix} file: use e.g. -o {out.with_suffix('')}/.")
    _check_sizes(args, options, name)
    if options.verify_runtime:  # the runtime named runs the target's graphs
        step.verify_runtime(options.verify_runtime, options.target, None)

    def progress(stage: str) -> None:
        if not args.quiet and stage:
            print(f"circleops: {stage}", file=sys.stderr)

    t = time.perf_counter()
    progress("loading the model")
    with scipy_hidden(args.model, options.config):
        loaded = recipe.from_source(args.model, options)
    load_seconds = time.perf_counter() - t
    report = step.run(loaded, out, progress)
    report.timings = {"load": load_seconds, **report.timings}
    return finish_graphs(report, args)


def _check_sizes(args: argparse.Namespace, options: Any, recipe: str) -> None:
    """A causal LM's sizes refused from its headers or config before any work and before torch's
    import (circleops.sources.sizes); then the dtype checks, which import torch."""
    if recipe != "LLMRecipe":
        return
    from circleops.package.files import refuse_plan_from_sizes
    from circleops.pipeline.validate import resolve_dtype, validate_quantize, validate_target_dtype
    from circleops.sources import sizes

    quantize = validate_quantize(options.quantize, options.target)
    # no file-size refusal: past the target's file limit the graphs are split into layer-range
    # files (circleops.package.split), whose plan refuses a layer too large alone: from the
    # headers here, before the model loads
    sizes.check_request(args.model, options.config, options.target, dtype=options.dtype, quantize=quantize,
                        max_cache_len=options.max_cache_len, graphs_verified=bool(options.verify_runtime))
    refuse_plan_from_sizes(args.model, options.config, options.target, quantize, options.max_file_bytes)
    validate_target_dtype(options.target, resolve_dtype(options.dtype, None), quantize)


def _check_vlm_sizes(args: argparse.Namespace, options: Any) -> None:
    """A vision-language model's sizes (its cache against the text model's positions, the
    memory) from config.json and the headers, before its recipe imports torch; nothing for a
    text model asked for the vision graph (its recipe says what is wrong)."""
    from circleops.package.vision_manifest import vlm_model_type
    from circleops.pipeline.validate import validate_quantize
    from circleops.sources import sizes

    if vlm_model_type(args.model, options.config) is not None:
        sizes.check_request(args.model, options.config, options.target, dtype=options.dtype, build=False,
                            quantize=validate_quantize(options.quantize, options.target),
                            max_cache_len=options.max_cache_len, graphs_verified=bool(options.verify_runtime))


def refuse_text2text(args: argparse.Namespace) -> None:
    """A text-to-text model is not one forward: say to convert its generation graphs."""
    from circleops.errors import TargetError
    from circleops.package.text2text_manifest import TEXT2TEXT_GRAPHS, text2text_model_type

    kind = text2text_model_type(args.model, args.config)
    if kind is not None and not args.task:
        raise TargetError(f"{args.config or args.model} is a text-to-text model ({kind}): it converts into its "
                          f"generation graphs, `circleops convert {args.model or 'DIR'} --graphs "
                          f"{','.join(TEXT2TEXT_GRAPHS)} --target onert -o OUT/`, then `circleops generate OUT/ "
                          f"--prompt \"...\"`.")
