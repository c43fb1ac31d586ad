"""``circleops check MODEL --dtype fp16``: the fp16/bf16 numerics report per norm policy
(circleops.tools.precision)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from circleops.tools import precision
    from circleops.tools.precision import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT, DTYPE_CHOICES, POLICY_NAMES

    parts = precision.__doc__.strip().replace("``", "").split("\n\n")
    parser.description = parts[0] + "\n\n" + parts[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="HF model directory, .gguf file, or smollm2 (as for convert)")
    parser.add_argument("--config", metavar="CONFIG_JSON",
                        help="build the model from this HF config.json with random weights (seed --seed)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp16",
                        help="precision of the checked files (default: fp16)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--prompt-ids", metavar="IDS",
                        help="prompt as comma-separated token ids (for models without a tokenizer)")
    parser.add_argument("-n", "--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, metavar="N",
                        help=f"greedy tokens compared with fp32 (default: {DEFAULT_NEW_TOKENS})")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), metavar="LIST",
                        help=f"comma-separated norm policies (default: {','.join(POLICY_NAMES)})")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw the error per layer per policy as a PNG (needs matplotlib)")
    parser.add_argument("--keep", metavar="DIR", help="write the .circle files to DIR and keep them")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights for --config (default 0)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads for fp32 and the interpreter (default: torch's; 1: fastest when busy)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines and no table")
    # GGML weight quantization instead of the fp16/bf16 policies (circleops.tools.quant_report)
    from circleops.quantize import INTEGER_FORMATS, WEIGHT_ONLY_FORMATS
    from circleops.tools.quant_report import DEFAULT_WINDOW

    parser.add_argument("--quantize", choices=list(WEIGHT_ONLY_FORMATS) + list(INTEGER_FORMATS), default=None,
                        metavar="FORMAT",
                        help="instead of --dtype: what GGML (q4_0, q4_0-pure, q8_0), w8 or integer (uint8, int16) "
                             "weights cost: layer and logits SQNR, greedy agreement, perplexity vs fp32")
    parser.add_argument("--runtime", choices=("onert", "reference", "litert"), default=None,
                        help="with --quantize: the runtime of the quantized file (default: onert, else the reference "
                             "interpreter; litert: w8 as a --target tflite file, attention inline as generate runs it)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="W",
                        help=f"with --quantize: perplexity window in tokens (default: {DEFAULT_WINDOW})")
    parser.add_argument("--max-windows", type=int, default=None, metavar="K",
                        help="with --quantize: score only the first K windows of the text (default: all)")
    from circleops.cli.integer import add_integer_arguments
    add_integer_arguments(parser)  # the integer recipe, as convert takes it
    parser.add_argument("--tico", action="store_true", help="with --quantize uint8/int16: also TICO's PTQ, same windows")


def main(args: argparse.Namespace) -> int:
    from circleops.sources import models
    from circleops.tools.precision import CheckOptions, check, directory_tokenizer, low_precision_dtype
    from circleops.cli.common import writable
    from circleops.errors import CircleOpsError, OutputError
    from circleops.numerics import norm_policy

    if args.model is None and args.config is None:
        raise CircleOpsError("no model given: pass MODEL (an HF directory, a .gguf file or smollm2), "
                             "or --config config.json for random weights.")
    if getattr(args, "quantize", None):
        return _quant_main(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        norm_policy(p)
    low_precision_dtype(args.dtype)
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids else None
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not writable(Path(path)):
            raise OutputError(f"cannot write {option} {Path(path)}: its directory does not exist, is not writable, "
                              "or the path is a directory. Choose another path.")
    if args.plot:
        from circleops.numerics.report import pyplot

        pyplot()  # a missing matplotlib fails now, not after the run
    _torch_threads(args.threads)
    progress = None if args.quiet else (lambda msg: print(f"circleops check: {msg}", file=sys.stderr, flush=True))
    t = time.perf_counter()
    loaded = models.load(args.model, config=args.config, seed=args.seed)
    if loaded.kind != "hf":
        raise CircleOpsError(f"{loaded.source} is not a Hugging Face causal LM: check needs the model itself (an "
                             "HF directory, a .gguf file, smollm2 or --config), not an ExportedProgram.")
    tokenizer = loaded.tokenizer or directory_tokenizer(args.model)
    load_seconds = time.perf_counter() - t
    options = CheckOptions(prompt=args.prompt, prompt_ids=prompt_ids, new_tokens=args.new_tokens, work_dir=args.keep,
                           source=loaded.source, dtype=args.dtype, policies=policies)
    report = check(loaded.module, tokenizer, options, progress=progress)
    report.timings = {"load": load_seconds, **report.timings}
    if args.json:
        report.to_json(args.json)
    if args.plot:
        report.plot(args.plot)
    if not args.quiet:
        print(report.table())
    return 0


def _quant_main(args: argparse.Namespace) -> int:
    """``check --quantize``: circleops.tools.quant_report on the loaded model."""
    from circleops.sources import models
    from circleops.errors import CircleOpsError
    from circleops.tools.precision import directory_tokenizer
    from circleops.tools.quant_report import QuantCheckOptions, quant_check
    from circleops.quantize.recipe import recipe_from_args

    _torch_threads(args.threads)
    progress = None if args.quiet else (lambda msg: print(f"circleops check: {msg}", file=sys.stderr, flush=True))
    t = time.perf_counter()
    recipe = recipe_from_args(args)  # the integer recipe, checked before the model loads
    loaded = models.load(args.model, config=args.config, seed=args.seed)
    if loaded.kind != "hf":
        raise CircleOpsError(f"{loaded.source} is not a Hugging Face causal LM: check needs the model itself.")
    tokenizer = loaded.tokenizer or directory_tokenizer(args.model)
    load_seconds = time.perf_counter() - t
    options = QuantCheckOptions(
        prompt=args.prompt, prompt_ids=_parse_ids(args.prompt_ids) if args.prompt_ids else None, tico=args.tico,
        new_tokens=args.new_tokens, work_dir=args.keep, source=loaded.source, quantize=args.quantize,
        window=args.window, max_windows=args.max_windows, runtime=args.runtime, recipe=recipe,
        calibration_data=args.calibration_data)
    report = quant_check(loaded.module, tokenizer, options, progress=progress)
    report.timings = {"load": load_seconds, **report.timings}
    if args.json:
        report.to_json(args.json)
    if not args.quiet:
        print(report.table())
    return 0


def _torch_threads(threads: int | None) -> None:
    if threads is not None:  # checked before torch sizes a pool with it
        from circleops.pipeline.validate import validate_threads
        import torch
        validate_threads(threads, "--threads"), torch.set_num_threads(threads)


def _parse_ids(text: str) -> list[int]:
    from circleops.errors import CircleOpsError

    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CircleOpsError(f"--prompt-ids {text!r}: give comma-separated integers, e.g. --prompt-ids "
                             "1,450,4996.") from None
