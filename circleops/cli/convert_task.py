"""``circleops convert DIR -o model.circle`` for a model that is not a causal LM (a ViT, a BERT,
a Whisper encoder...): the task comes from config.json or ``--task`` (circleops.recipes.tasks); the
options are circleops.cli.convert's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def task_of(args: argparse.Namespace) -> str | None:
    """The task to convert for, or None for the causal-LM path (and for .gguf, .pt2, smollm2)."""
    if args.graphs or (args.model is None and args.config is None):
        return None
    source = Path(args.config if args.config is not None else args.model)
    config = source / "config.json" if source.is_dir() else source
    if not config.is_file() or config.suffix != ".json":  # .gguf, .pt2, smollm2, a missing path...
        if args.task not in (None, "text-generation") and config.is_file():
            from circleops.errors import TargetError

            raise TargetError(f"--task {args.task} applies to Hugging Face models (a directory with config.json, "
                              f"or --config); {source} is not one.")
        return None  # circleops.sources.models says what it is
    from circleops.recipes import tasks
    from circleops.cli.common import scipy_hidden

    if args.task:
        task = tasks.check_task(args.task).name
    else:  # imports transformers and the model's class: the first import of transformers, so hide the unused
        with scipy_hidden(args.model, args.config):
            task = tasks.task_of(args.model, args.config)
    return None if task == "text-generation" else task


def main(args: argparse.Namespace, options: Any) -> int:
    from circleops.cli.common import ProgressBar, convert_stages, one_length, scipy_hidden, write_report, writable
    from circleops.errors import OutputError, TargetError
    from circleops.pipeline import convert as api
    from circleops.recipes import tasks
    from circleops.targets import PROFILES

    if options.quantize in api.INTEGER_FORMATS and options.int16:
        raise TargetError("--int16 parts name decoder-LLM modules; for a task model drop --int16.")
    dtype = api.resolve_dtype(options.dtype, None)
    quantize = api.validate_quantize(options.quantize, options.target)
    api.validate_target_dtype(options.target, dtype, quantize)
    out = api.validate_output_path(args.output, PROFILES[options.target].format)
    if args.report and not writable(Path(args.report)):
        raise OutputError(f"cannot write the report {Path(args.report)}: its directory does not exist or is not "
                          "writable. Choose another --report path.")
    options = options.replace(seq_len=one_length(options.seq_len, args.model or options.config))
    if options.verify_runtime:
        api.resolve_runtime(options.verify_runtime, options.target, dtype)
    progress = ProgressBar(convert_stages(args.model, options.fuse, bool(quantize), bool(options.verify_runtime)),
                           enabled=not args.quiet and sys.stderr.isatty())
    t = time.perf_counter()
    try:
        progress("load")
        with scipy_hidden(args.model, options.config):
            report = tasks.convert_task(args.model, out, options, progress=progress)
    finally:
        progress.close()
    report.timings = {"load": time.perf_counter() - t - sum(report.timings.values()), **report.timings}
    write_report(report, args.report)
    if not args.quiet:
        print(report.summary())
    return 0
