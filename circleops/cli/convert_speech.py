"""``circleops convert WHISPER_DIR --graphs encoder,prefill,decode -o DIR``: the speech graphs
(circleops.recipes.speech) of a Whisper-style model; the options are circleops.cli.convert's."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def wants_speech(args: argparse.Namespace) -> bool:
    """--graphs names the encoder, or MODEL is a Whisper directory (whose other --graphs
    lists convert_speech refuses, saying which it takes)."""
    from circleops.recipes.speech import speech_model_type

    names = {n.strip() for n in str(args.graphs).split(",")}
    return "encoder" in names or (args.model is not None and speech_model_type(args.model) is not None)


def main(args: argparse.Namespace) -> int:
    from circleops.recipes import speech
    from circleops.errors import OutputError, TargetError

    speech.parse_speech_graphs(args.graphs)
    if args.model is None:
        raise TargetError("--graphs encoder,prefill,decode needs the Whisper directory as MODEL (config.json, "
                          "safetensors, generation_config.json and the processor files); --config is not supported "
                          "for speech graphs.")
    refused = [flag for flag, given in (("--quantize", args.quantize), ("--dtype", args.dtype != "fp32"),
                                        ("--seq-len", args.seq_len is not None),
                                        ("--fuse", args.fuse not in ("auto", "adapters"))) if given]
    if refused:
        raise TargetError(f"{', '.join(refused)} do(es) not apply to speech graphs yet (fp32, the prefill is the "
                          f"{speech.PREFILL_LEN} start tokens, nothing to fuse: LayerNorm and biased attention); "
                          f"drop {'them' if len(refused) > 1 else 'it'}.")
    out = Path(args.output)
    if out.suffix.lower() in (".circle", ".tflite"):
        raise OutputError(f"with --graphs, -o names a directory (the graphs, manifest.json and the processor go "
                          f"into it), not a {out.suffix} file: use e.g. -o {out.with_suffix('')}/.")

    def progress(stage: str) -> None:
        if not args.quiet:
            print(f"circleops: {stage}", file=sys.stderr)

    report = speech.convert_speech(args.model, out, target=args.target, max_cache_len=args.max_cache_len,
                                   verify=args.runtime or bool(args.verify), tolerance=args.tolerance,
                                   progress=progress, threads=args.threads)
    from circleops.cli.common import finish_graphs

    return finish_graphs(report, args)
