"""``circleops generate DIR --audio clip.wav``: greedy speech-to-text with the graphs that
``circleops convert WHISPER_DIR --graphs encoder,prefill,decode -o DIR`` wrote (circleops.recipes.speech)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser, what: argparse._MutuallyExclusiveGroup) -> None:
    """--audio (in ``what``, beside --prompt), --language and --task."""
    from circleops.recipes.speech import TASK_NAMES  # light: no torch

    what.add_argument("--audio", metavar="WAV", help="transcribe this WAV file (PCM at the model's sampling rate) with "
                                                     "speech graphs (convert --graphs encoder,prefill,decode)")
    parser.add_argument("--language", metavar="LANG", help="with --audio: the spoken language (en, fr, english, ...; "
                                                           "default: detected, for multilingual models)")
    parser.add_argument("--task", choices=TASK_NAMES, default=None,
                        help="with --audio: transcribe, or translate into English (default: the model's)")


def check_text_arguments(args: argparse.Namespace) -> None:
    """--language and --task belong to --audio: refused with --prompt / --token-ids."""
    from circleops.errors import TargetError

    if args.language is not None or args.task is not None:
        raise TargetError("--language and --task apply to speech (--audio clip.wav), not to a text prompt.")


def main(args: argparse.Namespace) -> int:
    from circleops.errors import TargetError
    from circleops.generation.generator import TextStream
    from circleops.recipes.speech import SpeechGenerator

    given = [flag for flag, on in (("--chat", args.chat), ("--sample", args.sample),
                                   ("--repetition-penalty", args.repetition_penalty is not None)) if on]
    if given:
        raise TargetError(f"{', '.join(given)} do(es) not apply to --audio: speech generation is greedy, as "
                          f"transformers' Whisper generate with do_sample=False.")
    gen = SpeechGenerator(args.directory, runtime=args.runtime)
    if gen.note:
        print(f"circleops: {gen.note}", file=sys.stderr)

    def warn(message: str) -> None:
        print(f"circleops: {message}", file=sys.stderr)

    stream = TextStream(gen.processor.tokenizer, sys.stdout)
    result = gen.transcribe(args.audio, language=args.language, task=args.task,
                            max_new_tokens=args.max_new_tokens, on_token=stream, warn=warn)
    stream.close()
    if not args.quiet:
        lang = f" (language {result.language})" if result.language else ""
        print(result.timing_line() + lang, file=sys.stderr)
    return 0
