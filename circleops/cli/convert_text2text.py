"""``circleops convert T5_DIR --graphs encoder,prefill,decode -o DIR``: a text-to-text model's
graphs (circleops.recipes.text2text: T5, BART, mBART, Marian) through the package step; the
options are circleops.cli.convert's (``--input-shape input_ids=1xT``: the longest source)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def wants_text2text(args: argparse.Namespace) -> bool:
    """MODEL (or --config) is a text-to-text model circleops knows."""
    from circleops.recipes.text2text import text2text_model_type

    return text2text_model_type(args.model, args.config) is not None


def refuse_without_graphs(args: argparse.Namespace) -> None:
    """A text-to-text model is not one forward: say to convert its generation graphs."""
    from circleops.errors import TargetError
    from circleops.package.text2text_manifest import TEXT2TEXT_GRAPHS
    from circleops.recipes.text2text import text2text_model_type

    kind = text2text_model_type(args.model, args.config)
    if kind is not None and not args.task:
        raise TargetError(f"{args.config or args.model} is a text-to-text model ({kind}): it converts into its "
                          f"generation graphs, `circleops convert {args.model or 'DIR'} --graphs "
                          f"{','.join(TEXT2TEXT_GRAPHS)} --target onert -o OUT/`, then `circleops generate OUT/ "
                          f"--prompt \"...\"`.")


def main(args: argparse.Namespace) -> int:
    from circleops.cli.common import finish_graphs, scipy_hidden
    from circleops.errors import OutputError
    from circleops.options import ConvertOptions
    from circleops.package import step
    from circleops.recipes.tasks import parse_input_shapes
    from circleops.recipes.text2text import Text2TextRecipe

    options = ConvertOptions(
        target=args.target, dtype=None if args.dtype == "fp32" else args.dtype, verify=args.runtime or bool(args.verify),
        tolerance=args.tolerance, quantize=args.quantize, threads=args.threads, graphs=args.graphs,
        seq_len=args.seq_len, max_cache_len=args.max_cache_len, input_shape=parse_input_shapes(args.input_shape),
        max_file_bytes=args.max_file_bytes, config=args.config, seed=args.seed,
        onert_signatures={"on": True, "off": False}.get(args.onert_signatures))
    Text2TextRecipe.check_options(options, args.model)  # before the model loads
    out = Path(args.output)
    if out.suffix.lower() in (".circle", ".tflite"):
        raise OutputError(f"with --graphs, -o names a directory (the graphs, manifest.json and the tokenizer go "
                          f"into it), not a {out.suffix} file: use e.g. -o {out.with_suffix('')}/.")
    if options.verify:
        step.verify_runtime(options.verify, options.target, None)  # the runtime named runs the target's graphs

    def progress(stage: str) -> None:
        if not args.quiet and stage:
            print(f"circleops: {stage}", file=sys.stderr)

    t = time.perf_counter()
    progress("loading the model")
    with scipy_hidden(args.model, args.config):
        recipe = Text2TextRecipe.from_source(args.model, options)
    load_seconds = time.perf_counter() - t
    report = step.run(recipe, out, progress)
    report.timings = {"load": load_seconds, **report.timings}
    return finish_graphs(report, args)
