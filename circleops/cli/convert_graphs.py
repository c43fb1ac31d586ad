"""``circleops convert MODEL --graphs prefill,decode -o DIR``: the generation graphs
(circleops.recipes.llm) instead of one forward; the options are circleops.cli.convert's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_file_options(parser: argparse.ArgumentParser) -> None:
    """The --graphs options that shape the files: cache windows, onert's signatures, the file limit."""
    parser.add_argument("--cache-windows", metavar="W,...", default=None, help="with --graphs: the longest prefill also "
                        "reading only the first W cache slots, per W ('none': no such graphs; default: target tflite "
                        "C/2, C/4, ... down to twice the prefill length; docs/llm.md)")
    parser.add_argument("--onert-signatures", choices=("auto", "on", "off"), default="auto",
                        help="with --graphs --target onert: one file whose graphs share the weights, run through "
                             "onert 0.2.0.dev's C API (on), or a file per graph (off, what onert 0.1.0 runs); auto: "
                             "as the installed onert can (docs/llm.md)")
    parser.add_argument("--max-file-bytes", type=int, default=None, metavar="N",
                        help="with --graphs: the most one file may hold; past it the model is written as consecutive "
                             "files of a layer range each (default: 2 GiB for target onert, no limit otherwise)")


def main(args: argparse.Namespace) -> int:
    from circleops.pipeline import convert as api
    from circleops.recipes import llm as graphs
    from circleops.sources import models
    from circleops.cli.common import scipy_hidden
    from circleops.dtypes import float_dtype
    from circleops.package.manifest import graph_runtimes
    from circleops.errors import OutputError, TargetError

    from circleops.cli import convert_speech, convert_text2text
    if convert_text2text.wants_text2text(args):  # T5, BART, mBART, Marian: encoder, prefill, decode
        return convert_text2text.main(args)
    if convert_speech.wants_speech(args):  # Whisper: encoder, prefill, decode
        return convert_speech.main(args)
    from circleops.cli import vision

    if vision.is_vlm(args):
        return vision.convert_main(args)
    names = graphs.parse_graph_names(args.graphs)
    if args.model is None and args.config is None:
        raise TargetError("no model given: pass MODEL (an HF directory, a .gguf file or smollm2), or --config "
                          "config.json for random weights.")
    if args.model is not None and Path(args.model).suffix.lower() in (".pt2", ".pt", ".ep"):
        raise TargetError(f"--graphs needs the model itself, not an ExportedProgram ({args.model}): the prefill "
                          f"and decode graphs are exported from the model with its KV cache. Pass the HF directory, "
                          f".gguf file or smollm2.")
    if args.fuse not in ("auto", "adapters"):
        raise TargetError(f"--graphs always routes attention, RMSNorm and RoPE through the adapters (the cache "
                          f"lives in circle.attention); --fuse {args.fuse} cannot apply. Drop --fuse.")
    dtype = float_dtype(args.dtype)
    quantize = api.validate_quantize(getattr(args, "quantize", None), args.target)
    api.validate_target_dtype(args.target, dtype, quantize)
    prefill_len = graphs.prefill_lengths(graphs.DEFAULT_PREFILL_LENS if args.seq_len is None else args.seq_len)
    graphs.check_lengths(prefill_len[0], args.max_cache_len, None, args.model or args.config)
    graphs.parse_windows(getattr(args, "cache_windows", None))  # refused before the model loads
    from circleops.sources import sizes  # every refusal sizes decide, from the headers / config, before any work

    sizes.check(sizes.estimate(args.model, config=args.config, quantize=quantize, dtype=dtype), args.target,
                max_cache_len=args.max_cache_len)
    verify: bool | str = args.runtime or bool(args.verify)
    if verify and verify is not True and verify not in graph_runtimes(args.target):
        raise TargetError(f"--runtime {verify} cannot run target {args.target}'s files; use one of "
                          f"{', '.join(graph_runtimes(args.target))}.")
    out = Path(args.output)
    if out.suffix.lower() in (".circle", ".tflite"):
        raise OutputError(f"with --graphs, -o names a directory (the graphs, manifest.json and the tokenizer go "
                          f"into it), not a {out.suffix} file: use e.g. -o {out.with_suffix('')}/.")

    t = time.perf_counter()
    if not args.quiet:
        print("circleops: loading the model", file=sys.stderr)
    with scipy_hidden(args.model, args.config):
        loaded = models.load(args.model, config=args.config, dtype=dtype, seed=args.seed,
                             allow_random_init=getattr(args, "allow_random_init", False))
    if loaded.kind != "hf":
        raise TargetError(f"--graphs needs a Hugging Face causal LM; {loaded.source} is not one.")
    load_seconds = time.perf_counter() - t

    def progress(stage: str) -> None:
        if not args.quiet:
            print(f"circleops: {stage}", file=sys.stderr)

    report = graphs.convert_graphs(loaded.module, out, graphs=names, target=args.target, prefill_len=prefill_len,
                                   max_cache_len=args.max_cache_len, tokenizer=loaded.tokenizer, verify=verify,
                                   tolerance=args.tolerance, source=loaded.source, progress=progress,
                                   quantize=quantize, threads=getattr(args, "threads", None),
                                   cache_windows=graphs.parse_windows(getattr(args, "cache_windows", None)),
                                   max_file_bytes=getattr(args, "max_file_bytes", None),
                                   onert_signatures={"on": True, "off": False}.get(getattr(args, "onert_signatures",
                                                                                         "auto")))
    report.timings = {"load": load_seconds, **report.timings}
    from circleops.cli.common import finish_graphs

    return finish_graphs(report, args)
