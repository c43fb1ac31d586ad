"""The vision-language side of ``circleops convert`` (a VLM converts only into its graphs),
``generate --image`` and ``chat --image``; the commands' own modules call in here."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def refuse_without_graphs(args: argparse.Namespace) -> None:
    """A vision-language model is not one forward: say to convert its generation graphs."""
    from circleops.errors import TargetError
    from circleops.package.vision_manifest import VLM_GRAPH_NAMES, vlm_model_type

    kind = vlm_model_type(args.model, args.config)
    if kind is not None:
        raise TargetError(f"{args.config or args.model} is a vision-language model ({kind}): it converts into its "
                          f"generation graphs, `circleops convert {args.model or 'DIR'} --graphs "
                          f"{','.join(VLM_GRAPH_NAMES)} --target onert -o OUT/`, then `circleops generate OUT/ --image "
                          f"photo.png --prompt \"Describe it\"`.")


def generate_main(args: argparse.Namespace, manifest: Any, runtime: str, sampler: Any) -> int:
    """``circleops generate DIR --image PATH --prompt TEXT`` on a vision-language model."""
    from circleops.errors import TargetError
    from circleops.generation.generator import TextStream
    from circleops.generation.vision import VisionGenerator, prepare, read_image, saved_processor

    if args.prompt is None:
        raise TargetError("a vision-language model generates from --prompt TEXT (with --image PATH); --token-ids "
                          "cannot place an image.")
    images = [read_image(path) for path in args.image or ()]  # before any graph is opened
    gen = VisionGenerator(manifest, runtime=runtime, threads=getattr(args, 'threads', None))
    gen.check_chat(args.chat)
    processor = saved_processor(manifest)
    ids, pixels = prepare(processor, args.prompt, images, chat=args.chat, max_tokens=manifest.max_cache_len)
    gen.check_fits(len(ids), args.max_new_tokens)
    if not args.chat:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    stream = TextStream(processor.tokenizer, sys.stdout)
    result = gen.generate_with_image(ids, pixels, args.max_new_tokens, on_token=stream, sampler=sampler)
    stream.close()
    if not args.quiet:
        tiles = gen.vision_runs(pixels)
        print(f"{result.timing_line(manifest.prefill_len)}; {len(images)} image(s): {tiles} tile(s) through the "
              f"vision graph",
              file=sys.stderr)
    return 0


def vision_chat(args: argparse.Namespace, manifest: Any, runtime: str) -> Any:
    """The VisionChat of ``circleops chat DIR --image PATH`` (the images in the first message;
    ``/image PATH`` adds one to a later one)."""
    from circleops.generation.vision import VisionChat, VisionGenerator, read_image, saved_processor

    images = [read_image(path) for path in args.image or ()]  # before any graph is opened
    return VisionChat(VisionGenerator(manifest, runtime=runtime, threads=getattr(args, 'threads', None)),
                      saved_processor(manifest), images or None, system=args.system)
