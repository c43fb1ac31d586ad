"""``circleops convert DIR -o model.circle`` for a model that is not a causal LM (a ViT, a BERT,
a Whisper encoder...): the task comes from config.json or ``--task`` (circleops.recipes.tasks); the
options are circleops.cli.convert's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


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


def main(args: argparse.Namespace, task: str) -> int:
    from circleops.pipeline import convert as api
    from circleops.recipes import tasks
    from circleops.cli.common import ProgressBar, convert_stages, one_length, scipy_hidden, write_report, writable
    from circleops.dtypes import float_dtype
    from circleops.errors import OutputError, TargetError
    from circleops.targets import PROFILES

    if args.quantize in api.INTEGER_FORMATS and args.int16:
        raise TargetError("--int16 parts name decoder-LLM modules; for a task model drop --int16.")
    dtype = float_dtype(args.dtype)
    quantize = api.validate_quantize(args.quantize, args.target)
    api.validate_target_dtype(args.target, dtype, quantize)
    out = api.validate_output_path(args.output, PROFILES[args.target].format)
    if args.report and not writable(Path(args.report)):
        raise OutputError(f"cannot write the report {Path(args.report)}: its directory does not exist or is not "
                          "writable. Choose another --report path.")
    shapes = tasks.parse_input_shapes(args.input_shape)
    verify: bool | str = args.runtime or bool(args.verify)
    if verify:
        api.resolve_runtime(verify, args.target, dtype)
    extra = dict(calibrate=args.calibrate, calibration_data=args.calibration_data) \
        if quantize in api.INTEGER_FORMATS else {}
    progress = ProgressBar(convert_stages(args.model, args.fuse, bool(quantize), bool(verify)),
                           enabled=not args.quiet and sys.stderr.isatty())
    t = time.perf_counter()
    try:
        progress("load")
        with scipy_hidden(args.model, args.config):
            report = tasks.convert_task(args.model, out, task=task, config=args.config,
                                        seq_len=one_length(args.seq_len, args.model or args.config),
                                        input_shape=shapes, dtype=dtype, seed=args.seed,
                                        allow_random_init=args.allow_random_init, target=args.target, fuse=args.fuse,
                                        verify=verify, tolerance=args.tolerance, progress=progress,
                                        quantize=quantize, threads=args.threads, **extra)
    finally:
        progress.close()
    report.timings = {"load": time.perf_counter() - t - sum(report.timings.values()), **report.timings}
    write_report(report, args.report)
    if not args.quiet:
        print(report.summary())
    return 0
