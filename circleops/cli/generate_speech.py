"""``circleops generate DIR --audio clip.wav``: speech-to-text with the graphs that
``circleops convert WHISPER_DIR --graphs encoder,prefill,decode -o DIR`` wrote
(circleops.generation.speech): greedy, or --sample; --threads as for a text model."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser, what: argparse._MutuallyExclusiveGroup) -> None:
    """--audio (in ``what``, beside --prompt), --language and --task."""
    from circleops.generation.speech import TASK_NAMES  # light: no torch

    what.add_argument("--audio", metavar="WAV", help="transcribe this WAV file (PCM at the model's sampling rate) with "
                                                     "speech graphs (convert --graphs encoder,prefill,decode)")
    parser.add_argument("--language", metavar="LANG", help="with --audio: the spoken language (en, fr, english, ...; "
                                                           "default: detected, for multilingual models); with a text-to-text "
                                                           "model, the target-language token forced first (mBART's de_DE)")
    parser.add_argument("--task", choices=TASK_NAMES, default=None,
                        help="with --audio: transcribe, or translate into English (default: the model's)")


def check_text_arguments(args: argparse.Namespace) -> None:
    """--language and --task belong to --audio (or --language to a text-to-text model):
    refused with --prompt / --token-ids on a decoder-only model."""
    from circleops.errors import TargetError

    if args.language is not None or args.task is not None:
        raise TargetError("--language and --task apply to speech (--audio clip.wav), not to a text prompt.")


def main(args: argparse.Namespace, sampler: Any = None) -> int:
    """``generate --audio``; ``sampler``: what --sample and its flags asked for (None: greedy),
    built by circleops.cli.generate before any graph opens."""
    from circleops.errors import TargetError
    from circleops.generation.generator import TextStream
    from circleops.generation.speech import SpeechGenerator

    if args.chat:
        raise TargetError("--chat does not apply to --audio: a Whisper model transcribes one clip, it has no chat "
                          "template.")
    gen = SpeechGenerator(args.directory, runtime=args.runtime, threads=args.threads)
    if gen.note:
        print(f"circleops: {gen.note}", file=sys.stderr)

    def warn(message: str) -> None:
        print(f"circleops: {message}", file=sys.stderr)

    stream = TextStream(gen.processor.tokenizer, sys.stdout)
    result = gen.transcribe(args.audio, language=args.language, task=args.task,
                            max_new_tokens=args.max_new_tokens, on_token=stream, warn=warn, sampler=sampler)
    stream.close()
    if not args.quiet:
        lang = f" (language {result.language})" if result.language else ""
        how = f"; {sampler.config.describe()}" if sampler is not None else ""
        print(result.timing_line() + lang + how, file=sys.stderr)
    return 0
