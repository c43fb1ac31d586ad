"""The vision-language side of ``circleops convert --graphs``, ``generate --image`` and
``chat --image`` (circleops.recipes.vlm); the commands' own modules call in here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def is_vlm(args: argparse.Namespace) -> bool:
    """A vision-language model directory (or config), or --graphs naming the vision graph."""
    from circleops.recipes.vlm import VISION_GRAPH, vlm_model_type

    asked = VISION_GRAPH in [g.strip() for g in str(getattr(args, "graphs", None) or "").split(",")]
    return asked or vlm_model_type(args.model, args.config) is not None


def refuse_without_graphs(args: argparse.Namespace) -> None:
    """A vision-language model is not one forward: say to convert its generation graphs."""
    from circleops.errors import TargetError
    from circleops.recipes.vlm import VLM_GRAPH_NAMES, vlm_model_type

    kind = vlm_model_type(args.model, args.config)
    if kind is not None:
        raise TargetError(f"{args.config or args.model} is a vision-language model ({kind}): it converts into its "
                          f"generation graphs, `circleops convert {args.model or 'DIR'} --graphs "
                          f"{','.join(VLM_GRAPH_NAMES)} --target onert -o OUT/`, then `circleops generate OUT/ --image "
                          f"photo.png --prompt \"Describe it\"`.")


def convert_main(args: argparse.Namespace) -> int:
    from circleops.recipes import llm as graphs
    from circleops.recipes import vlm
    from circleops.errors import TargetError

    vlm.parse_vlm_graphs(args.graphs)
    if vlm.vlm_model_type(args.model, args.config) is None:
        raise TargetError(f"--graphs {args.graphs}: the vision graph is for vision-language models (model_type "
                          f"{', '.join(vlm.VLM_MODEL_TYPES)}); {args.config or args.model or 'no model'} is not one. "
                          f"Use --graphs prefill,decode for a causal LM.")
    if args.dtype != "fp32":
        raise TargetError(f"--dtype {args.dtype}: a vision-language model's graphs compute in fp32 so far (--quantize "
                          f"q4_0, q8_0 or w8 makes its text graphs' weights smaller); drop --dtype.")
    out = Path(args.output)
    if out.suffix.lower() in (".circle", ".tflite"):
        raise TargetError(f"with --graphs, -o names a directory, not a {out.suffix} file: use e.g. "
                          f"-o {out.with_suffix('')}/.")
    if not args.quiet:
        print("circleops: loading the model", file=sys.stderr)
    model, processor = vlm.load(args.model, config=args.config, seed=args.seed)

    def progress(stage: str) -> None:
        if not args.quiet and stage:
            print(f"circleops: {stage}", file=sys.stderr)

    lengths = graphs.prefill_lengths(graphs.DEFAULT_PREFILL_LENS if args.seq_len is None else args.seq_len)
    report = vlm.convert_vlm_graphs(model, out, processor=processor, target=args.target, prefill_len=lengths,
                                    max_cache_len=args.max_cache_len, verify=args.runtime or bool(args.verify),
                                    tolerance=args.tolerance, source=str(args.config or args.model), progress=progress,
                                    quantize=getattr(args, "quantize", None), threads=getattr(args, "threads", None))
    from circleops.cli.common import finish_graphs

    return finish_graphs(report, args, report.summary().replace('--prompt "..."', '--image photo.png --prompt "..."'))


def generate_main(args: argparse.Namespace, manifest: Any, runtime: str, sampler: Any) -> int:
    """``circleops generate DIR --image PATH --prompt TEXT`` on a vision-language model."""
    from circleops.errors import TargetError
    from circleops.generation.generator import TextStream
    from circleops.generation.vision import VisionGenerator, prepare, read_image, saved_processor

    if args.prompt is None:
        raise TargetError("a vision-language model generates from --prompt TEXT (with --image PATH); --token-ids "
                          "cannot place an image.")
    image = read_image(args.image) if args.image else None  # before any graph is opened
    gen = VisionGenerator(manifest, runtime=runtime, threads=getattr(args, 'threads', None))
    gen.check_chat(args.chat)
    processor = saved_processor(manifest)
    ids, pixels = prepare(processor, args.prompt, image, chat=args.chat)
    gen.check_fits(len(ids), args.max_new_tokens)
    if not args.chat:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    stream = TextStream(processor.tokenizer, sys.stdout)
    result = gen.generate_with_image(ids, pixels, args.max_new_tokens, on_token=stream, sampler=sampler)
    stream.close()
    if not args.quiet:
        tiles = 0 if pixels is None else int((pixels.reshape(-1, *pixels.shape[-3:]) != 0).any(axis=(1, 2, 3)).sum())
        print(f"{result.timing_line(manifest.prefill_len)}; image: {tiles} tile(s) through the vision graph",
              file=sys.stderr)
    return 0


def vision_chat(args: argparse.Namespace, manifest: Any, runtime: str) -> Any:
    """The VisionChat of ``circleops chat DIR --image PATH`` (the image in the first message)."""
    from circleops.generation.vision import VisionChat, VisionGenerator, read_image, saved_processor

    image = read_image(args.image) if args.image else None
    return VisionChat(VisionGenerator(manifest, runtime=runtime, threads=getattr(args, 'threads', None)), saved_processor(manifest), image,
                      system=args.system)
